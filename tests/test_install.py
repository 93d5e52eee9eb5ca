"""`pip install dtp-layout` without extras, for real: a fresh virtual environment, the package installed from a
copy of this checkout, and what the base install promises (pyproject.toml, app/cli/extras.py): no torch and no
transformers, `pip check` clean, the client, keys, the torch-free `score` and `layout` commands, the API
(`serve --no-worker` on SQLite, migrations included) answering over HTTP, and every model command
refused in one line naming `pip install 'dtp-layout[worker]'`.

Marked `install`: skipped where pip cannot reach a package index, failed then under CI=true. pip's
cache is used, so after the first run it takes about half a minute.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import httpx
import pytest

from app.cli.extras import WORKER_INSTALL, WORKER_PACKAGES
from tests.service_kit import ServeProcess

pytestmark = pytest.mark.install

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
PIP_TIMEOUT_S = 600


def _skip_or_fail(message: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true: {message}", pytrace=False)
    pytest.skip(message)


def _requirement_name(requirement: str) -> str:
    """The distribution name of a requirement string ("psycopg[binary]>=3.1" → "psycopg")."""
    end = next((i for i, c in enumerate(requirement) if not (c.isalnum() or c in "-_.")), len(requirement))
    return requirement[:end].lower().replace("_", "-")


def _source_copy(dest: Path) -> Path:
    """What the build reads (pyproject.toml, the README, the packages), so that no build/ or egg-info lands
    in the checkout."""
    dest.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, dest / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    # the top-level folders of the packages it includes (`migrations.versions` lives in `migrations/`)
    include = PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]
    folders = {pattern.rstrip("*").split(".")[0] for pattern in include}
    for folder in sorted(folders):
        shutil.copytree(REPO / folder, dest / folder, ignore=ignore)
    return dest


class BaseInstall:
    """The fresh environment: its `bin/`, and the environment its commands run in (no PYTHONPATH, so that
    only the installed copy is imported, from a directory outside the checkout)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.bin = root / "venv" / "bin"
        self.cwd = root / "run"
        self.cwd.mkdir()
        self.env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("DTP_LAYOUT_")}
        self.env["DTP_LAYOUT_VAR_DIR"] = str(root / "var")

    def run(self, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        program = argv[0] if argv[0].startswith("/") else str(self.bin / argv[0])
        return subprocess.run([program, *argv[1:]], cwd=self.cwd, env=self.env, capture_output=True, text=True,
                              timeout=timeout)


@pytest.fixture(scope="module")
def base_install(tmp_path_factory) -> BaseInstall:
    root = tmp_path_factory.mktemp("base-install")
    venv = subprocess.run([sys.executable, "-m", "venv", str(root / "venv")], capture_output=True, text=True)
    if venv.returncode != 0:
        _skip_or_fail(f"cannot make a virtual environment: {venv.stderr.strip()[-500:]}")
    install = BaseInstall(root)
    # Can pip reach an index at all? (a small download through the same configuration the install uses)
    probe = install.run("python", "-m", "pip", "download", "--no-deps", "--dest", str(root / "probe"), "setuptools>=77",
                        timeout=PIP_TIMEOUT_S)
    if probe.returncode != 0:
        _skip_or_fail(f"pip cannot reach a package index: {probe.stderr.strip()[-500:]}")
    source = _source_copy(root / "src")
    result = install.run("python", "-m", "pip", "install", "--no-compile", str(source), timeout=PIP_TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-3000:]
    return install


def test_base_install_has_no_model_stack_and_pip_check_passes(base_install):
    listed = base_install.run("python", "-m", "pip", "list", "--format", "json")
    installed = {entry["name"].lower().replace("_", "-") for entry in json.loads(listed.stdout)}
    assert "dtp-layout" in installed
    worker_extra = {_requirement_name(r) for r in PYPROJECT["project"]["optional-dependencies"]["worker"]}
    assert {"torch", "transformers"} <= worker_extra
    assert not installed & worker_extra, f"the base install pulled {sorted(installed & worker_extra)}"
    check = base_install.run("python", "-m", "pip", "check")
    assert check.returncode == 0, check.stdout + check.stderr


def test_model_commands_name_the_worker_extra(base_install):
    for argv in (["optimise", "m", "--devices", "3", "--calib", "corpus:shakespeare", "--out", "out"],
                 ["distill", "m", "--devices", "3", "--data", "corpus:shakespeare", "--out", "out"],
                 ["eval", "m", "--devices", "3", "--data", "corpus:shakespeare"],
                 ["generate", "shards", "--prompt", "x"], ["worker"], ["serve"]):
        result = base_install.run("dtp-layout", *argv)
        assert result.returncode == 2, (argv, result.stdout, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and WORKER_INSTALL in lines[0] and "torch" in lines[0], (argv, result.stderr)
        assert "Traceback" not in result.stderr and result.stdout == ""
    help_text = base_install.run("dtp-layout", "optimise", "--help")
    assert help_text.returncode == 0 and WORKER_INSTALL in " ".join(help_text.stdout.split())


def test_torch_free_commands_run(base_install):
    help_text = base_install.run("dtp-layout", "client", "--help")
    assert help_text.returncode == 0 and "submit" in help_text.stdout and "scores" in help_text.stdout
    # an affinity and a layout written by the installed package itself, then rescored and re-optimised
    make = ("import sys, numpy as np\n"
            "from models.affinity.file import AffinityResult\n"
            "from models.base.shapes import ModelShape\n"
            "from models.layouts.layout import contiguous\n"
            "rng = np.random.default_rng(0); shape = ModelShape('llama', 2, 2, 4, 8, hidden_size=8, head_dim=4)\n"
            "AffinityResult([rng.random((2, 8)) for _ in range(2)], [rng.random((2, 8)) for _ in range(2)],\n"
            "               [rng.random((8, 2))], tokens=16, shape=shape).save('affinity.safetensors')\n"
            "contiguous(shape, 2).save('contiguous.json')\n"
            f"assert not any(m in sys.modules for m in {WORKER_PACKAGES!r})\n")
    made = base_install.run("python", "-c", make)
    assert made.returncode == 0, made.stderr
    layout = base_install.run("dtp-layout", "layout", "--affinity", "affinity.safetensors", "--devices", "2",
                              "--out", "optimised.json")
    assert layout.returncode == 0, layout.stderr
    scores = base_install.run("dtp-layout", "score", "--affinity", "affinity.safetensors", "--json",
                              "contiguous.json", "optimised.json")
    assert scores.returncode == 0, scores.stderr
    by_name = {row["name"]: row["J"] for row in json.loads(scores.stdout)["layouts"]}
    assert by_name["optimised"] >= by_name["contiguous"]


def test_api_serves_from_the_base_install(base_install):
    key = base_install.run("dtp-layout", "keys", "create", "ci")  # migrates the database, then stores the key
    assert key.returncode == 0, key.stderr
    serve = ServeProcess(base_install.root / "var", program=[str(base_install.bin / "dtp-layout")],
                         options=["--no-worker"])
    serve.env.pop("PYTHONPATH", None)  # the installed copy only
    try:
        banner = serve.start().banner()
        assert "none (--no-worker)" in banner, banner
        with httpx.Client(base_url=serve.url, timeout=30) as client:
            assert client.get("/healthz").status_code == 200
            assert client.get("/readyz").json()["checks"] == {"database": "ok", "broker": "ok"}
            assert client.get("/ui/").status_code == 200
            assert client.get("/v1/jobs").status_code == 401  # the key made above closed the API
            headers = {"X-API-Key": key.stdout.strip()}
            assert client.get("/v1/jobs", headers=headers).json()["items"] == []
            refused = client.post("/v1/jobs", headers=headers, json={
                "model": {"id": "missing"}, "devices": 3, "calibration": {"source": "corpus:shakespeare"}})
            assert refused.status_code == 422 and refused.json()["detail"][0]["field"] == "model.id"
    finally:
        serve.stop()

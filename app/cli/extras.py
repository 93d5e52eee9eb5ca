"""The `worker` extra of pyproject.toml, as the command line sees it.

The base install (`pip install -e .` in a checkout, or the wheel `make dist` builds: dtp-layout is on no
public index) is the service without the model stack: the API, the dashboard, the client and the torch-free
commands (`client`, `keys`, `migrate`, `serve --no-worker`, `score`, `layout`). The model commands and the
worker need the `worker` extra; without it they exit 2 with one line naming the install that adds it (from
the checkout this code runs from, or the wheel), never a traceback. Torch-free: this module only asks
whether the packages exist.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
from pathlib import Path

# Import names of the worker extra's packages (tests/test_packaging.py checks them against pyproject.toml).
WORKER_PACKAGES = ("torch", "transformers", "tokenizers", "accelerate", "matplotlib")
WORKER_INSTALL = "pip install -e '.[worker]'"  # in a checkout; `worker_install` says where, or the wheel
DISTRIBUTION = "dtp-layout"


def checkout_root() -> Path | None:
    """The checkout this code runs from (an editable install, PYTHONPATH), or None for an installed copy."""
    root = Path(__file__).resolve().parents[2]
    pyproject = root / "pyproject.toml"
    return root if pyproject.is_file() and f'name = "{DISTRIBUTION}"' in pyproject.read_text() else None


def wheel_name() -> str:
    """The file name of the wheel `make dist` builds for this version (dtp_layout-0.1.0-py3-none-any.whl)."""
    try:
        version = importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        version = "VERSION"
    return f"{DISTRIBUTION.replace('-', '_')}-{version}-py3-none-any.whl"


def worker_install() -> str:
    """How to add the worker extra, in words that work where this runs: the package is on no public index."""
    root = checkout_root()
    where = f"in the checkout ({root})" if root is not None else "in a dtp-layout checkout"
    return f"{WORKER_INSTALL} {where}, or pip install 'dist/{wheel_name()}[worker]' (the wheel `make dist` builds)"


def missing_worker_packages() -> list[str]:
    """The worker extra's packages this environment lacks (found without importing any of them)."""
    return [name for name in WORKER_PACKAGES if importlib.util.find_spec(name) is None]


def worker_extra_message(missing: list[str]) -> str:
    return f"needs the worker extra ({', '.join(missing)} not installed): {worker_install()}"


def needs_worker_extra(parser: argparse.ArgumentParser) -> None:
    """Mark a command as one that needs the worker extra: its --help says so, and `refusal` stops it
    before it runs when the extra is missing."""
    parser.set_defaults(needs_worker_extra=True)
    parser.epilog = f"Needs the worker extra: {worker_install()}"


def refusal(args: argparse.Namespace) -> str | None:
    """The one-line error for a command that needs the worker extra where it is missing, else None."""
    if not getattr(args, "needs_worker_extra", False):
        return None
    missing = missing_worker_packages()
    return worker_extra_message(missing) if missing else None


def missing_module_message(exc: ModuleNotFoundError) -> str | None:
    """The one-line error for an import of a worker-extra package that failed, else None (another
    missing module is a bug, and keeps its traceback)."""
    top = (exc.name or "").partition(".")[0]
    return worker_extra_message([top]) if top in WORKER_PACKAGES else None

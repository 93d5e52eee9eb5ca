"""The `worker` extra of pyproject.toml, as the command line sees it.

`pip install dtp-layout` is the service without the model stack: the API, the dashboard, the client and
the torch-free commands (`client`, `keys`, `migrate`, `serve --no-worker`, `score`, `layout`). The model
commands and the worker need `pip install 'dtp-layout[worker]'`; without it they exit 2 with one line
naming that command, never a traceback. Torch-free: this module only asks whether the packages exist.
"""

from __future__ import annotations

import argparse
import importlib.util

# Import names of the worker extra's packages (tests/test_packaging.py checks them against pyproject.toml).
WORKER_PACKAGES = ("torch", "transformers", "tokenizers", "accelerate", "matplotlib")
WORKER_INSTALL = "pip install 'dtp-layout[worker]'"


def missing_worker_packages() -> list[str]:
    """The worker extra's packages this environment lacks (found without importing any of them)."""
    return [name for name in WORKER_PACKAGES if importlib.util.find_spec(name) is None]


def worker_extra_message(missing: list[str]) -> str:
    return f"needs the worker extra ({', '.join(missing)} not installed): {WORKER_INSTALL}"


def needs_worker_extra(parser: argparse.ArgumentParser) -> None:
    """Mark a command as one that needs the worker extra: its --help says so, and `refusal` stops it
    before it runs when the extra is missing."""
    parser.set_defaults(needs_worker_extra=True)
    parser.epilog = f"Needs the worker extra: {WORKER_INSTALL}"


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

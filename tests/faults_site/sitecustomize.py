"""Imported at the start of every Python process whose PYTHONPATH has this directory, which only the
tests put there (tests/faults.py `Faults.env`): once the process imports `worker.jobs` (or
`worker.claiming`), the faults in DTP_TEST_FAULTS are installed on it. Nothing else is imported here,
so an API process started with the same environment stays free of the worker and torch."""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
from typing import Any


class _InstallFaultsAfterImport(importlib.abc.MetaPathFinder):
    def __init__(self, target: str, installer: str) -> None:
        self.target, self.installer = target, installer

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != self.target:
            return None
        sys.meta_path.remove(self)  # the real finders find it; this only wraps its loading
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        load = loader.exec_module

        def exec_module(module: Any) -> None:
            load(module)
            from tests import faults as kit

            faults = kit.Faults.from_env()
            if faults is not None:
                getattr(kit, self.installer)(faults)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if os.environ.get("DTP_TEST_FAULTS"):
    sys.meta_path.insert(0, _InstallFaultsAfterImport("worker.jobs", "install"))
    sys.meta_path.insert(0, _InstallFaultsAfterImport("worker.claiming", "install_claim_faults"))

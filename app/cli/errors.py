"""The errors of the command line a user can fix: printed as one line without a traceback, exit status 2."""

from __future__ import annotations

import sys


class CliError(Exception):
    """An error the user can fix: printed without a traceback, exit status 2."""




# The errors a user can fix, by the module that defines them (besides ValueError and CliError). A class can
# only have been raised once its module was imported, so only the imported ones are looked up: a torch-free
# command never imports torch to classify its error.
_USER_ERRORS = {"models.io.assets": "AssetNotFoundError", "models.data.calibration": "DataError",
                "models.streaming.memory_plan": "MemoryLimitError", "models.io.sizes": "SizeError",
                "models.export.files": "ExportError", "models.families": "UnsupportedModelError",
                "models.base.layout_format": "LayoutError", "models.io.loading": "ModelLoadError"}


def user_errors() -> tuple[type[BaseException], ...]:
    imported = (getattr(sys.modules[module], name) for module, name in _USER_ERRORS.items() if module in sys.modules)
    return (ValueError, CliError, *imported)


"""The `dtp-layout` command: the composition root that starts the API, the worker and the model commands.
"""

from app.cli.main import main

__all__ = ["main"]

"""The command line's hooks for `models.run.runner`: stages recorded in the output directory's run.json,
progress bars and what is skipped on stderr. Used by `optimise` (app/cli/commands/optimise.py) and `distill`
(app/cli/commands/distill.py). Torch-free at import.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from models.run.runner import Hooks, Note, RunRecord, Stage


class CliHooks(Hooks):
    def __init__(self, command: str, *, model: str, record: RunRecord | None = None,
                 progress: Callable[[str, float], None] | None = None) -> None:
        self.command, self.model, self.record, self._progress = command, model, record, progress

    def is_done(self, stage: Stage[Any]) -> bool:
        return self.record is not None and self.record.is_done(stage)

    def skipped(self, stage: Stage[Any]) -> None:
        assert self.record is not None
        print(f"{self.command}: {stage.name}: done by an earlier run in {self.record.run_dir}; skipped",
              file=sys.stderr)

    def before(self, stage: Stage[Any]) -> None:
        if stage.name == "loading":
            print(f"loading {self.model} …", file=sys.stderr)

    def after(self, stage: Stage[Any], note: Note, seconds: float) -> None:
        if stage.name == "loading":
            print(f"loaded in {seconds:.1f}s" + ("" if note.get("weights") else " (config only: no stage to run "
                                                                                  "needs the weights)"),
                  file=sys.stderr)
        if self.record is not None and stage.resumable:
            self.record.record(stage.name, note, seconds)

    def progress(self, stage: str, fraction: float) -> None:
        if self._progress is not None:
            self._progress(stage, fraction)

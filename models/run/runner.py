"""One resumable stage runner: a declared list of stages, run in order, the finished ones skipped.

A `Stage` names what it reads and writes under the run directory (`inputs`, `outputs`), whether it
applies to this run, how its work is done (`run`, which returns what to record with it) and how its
outputs come back into memory when a later stage needs them (`restore`). Who runs the stages (the
`dtp-layout optimise` command, a worker's job) supplies the `Hooks`: where completion is recorded and
read back (`is_done`, `after`), what happens around each stage (`before`, `skipped`, `execute`),
progress and the stop check. The stage list itself is in `models.run.stages`. Torch-free.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Generic, TypeVar

from models.io.atomic import atomic_write_json
from models.run.files import RUN_FILE

Note = dict[str, Any]  # what a stage's run returns: recorded with its completion


class StageContext:
    """What every run's context carries for the runner: the stages still to run this time (set before
    the first stage runs, so that an early stage can skip work only finished stages needed)."""

    pending: frozenset[str] = frozenset()


C = TypeVar("C", bound=StageContext)


def _always(_ctx: Any) -> bool:
    return True


@dataclass(frozen=True)
class Stage(Generic[C]):
    name: str
    run: Callable[[C, Hooks], Note | None]
    inputs: tuple[str, ...] = ()  # paths under the run directory that earlier stages wrote
    outputs: tuple[str, ...] = ()  # paths under the run directory this stage writes
    applies: Callable[[C], bool] = _always
    restore: Callable[[C], None] | None = None  # a finished stage's outputs back into the context
    resumable: bool = True  # False: done again on every run (what it makes lives in memory)
    checks_stop: bool = False  # True: the work polls should_stop; False: only its safe points (progress.check_stop)


class Hooks:
    """What the caller does around the stages; every method has a do-nothing default."""

    def is_done(self, stage: Stage[Any]) -> bool:
        """Whether the stage finished in an earlier run (its outputs present and its completion recorded)."""
        return False

    def skipped(self, stage: Stage[Any]) -> None:
        """A finished stage was not run again."""

    def before(self, stage: Stage[Any]) -> None:
        """The stage starts (the worker: the lease and cancel checks, the stage row)."""

    def execute(self, stage: Stage[Any], fn: Callable[[], Note | None]) -> Note | None:
        """Run the stage's work (the worker: unless it checks_stop, in a thread under the run's stop signal,
        waited for until it stops)."""
        return fn()

    def after(self, stage: Stage[Any], note: Note, seconds: float) -> None:
        """Record the stage as done, with its note and its wall seconds."""

    def progress(self, stage: str, fraction: float) -> None:
        """The fraction of the stage done."""

    def should_stop(self) -> bool:
        """Polled between units of work; True stops the work (it raises `models.base.progress.Cancelled`)."""
        return False

    def abandonable(self, fn: Callable[[], Any]) -> Any:
        """A blocking call inside a stage that checks_stop (a download, a checkpoint read)."""
        return fn()


@dataclass(frozen=True)
class Outcome:
    ran: tuple[str, ...]
    skipped: tuple[str, ...]
    seconds: dict[str, float]


def plan(stages: Sequence[Stage[C]], ctx: C, hooks: Hooks) -> tuple[list[Stage[C]], set[str]]:
    """The stages that apply to this run and the names of those finished earlier. Finished means a
    prefix: once one stage must run, every later one runs too (its inputs may change)."""
    applying = [s for s in stages if s.applies(ctx)]
    done: set[str] = set()
    for stage in applying:
        if not stage.resumable:
            continue
        if not hooks.is_done(stage):
            break
        done.add(stage.name)
    return applying, done


def run_stages(stages: Sequence[Stage[C]], ctx: C, hooks: Hooks, *, keep: Sequence[str] = ()) -> Outcome:
    """Run the stages that apply, in order, skipping the finished ones. A finished stage's outputs are
    restored into `ctx` when a stage still to run reads them, or when they are in `keep` (what the
    caller reads after the run, e.g. for its report)."""
    applying, done = plan(stages, ctx, hooks)
    ctx.pending = frozenset(s.name for s in applying if s.name not in done)
    needed = {path for s in applying if s.name in ctx.pending for path in s.inputs} | set(keep)
    ran, skipped, seconds = [], [], {}
    for stage in applying:
        if stage.name in done:
            hooks.skipped(stage)
            skipped.append(stage.name)
            if stage.restore is not None and needed & set(stage.outputs):
                stage.restore(ctx)
            continue
        hooks.before(stage)
        t0 = time.perf_counter()
        note = hooks.execute(stage, partial(stage.run, ctx, hooks)) or {}
        seconds[stage.name] = round(time.perf_counter() - t0, 3)
        hooks.after(stage, note, seconds[stage.name])
        ran.append(stage.name)
    return Outcome(ran=tuple(ran), skipped=tuple(skipped), seconds=seconds)


RUN_FORMAT = "dtp-layout-run/1"


class RunRecord:
    """A run directory's own record of a run (`run.json`): the parameters it was started with and, per
    finished stage, what the stage recorded and its wall seconds. A stage is done when it is recorded
    here and its outputs are present; a rerun with other parameters must not resume from it."""

    def __init__(self, run_dir: Path, parameters: dict[str, Any]) -> None:
        self.run_dir, self.path = run_dir, run_dir / RUN_FILE
        self.parameters = parameters
        self.stages: dict[str, dict[str, Any]] = {}

    @staticmethod
    def read(run_dir: Path) -> dict[str, Any] | None:
        """The record in run_dir, or None without one; ValueError for one that is not a run record."""
        path = run_dir / RUN_FILE
        try:
            doc = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise ValueError(f"{path}: not a readable run record ({exc})") from exc
        if not isinstance(doc, dict) or doc.get("format") != RUN_FORMAT or not isinstance(doc.get("stages"), dict) \
                or not isinstance(doc.get("parameters"), dict):
            raise ValueError(f"{path}: not a {RUN_FORMAT} run record")
        return doc

    def differences(self, earlier: dict[str, Any]) -> list[tuple[str, Any, Any]]:
        """(parameter, earlier value, this run's value) for every parameter that differs."""
        before = earlier["parameters"]
        return [(name, before.get(name), self.parameters.get(name))
                for name in sorted(set(before) | set(self.parameters)) if before.get(name) != self.parameters.get(name)]

    def resume(self, earlier: dict[str, Any]) -> None:
        self.stages = dict(earlier["stages"])

    def is_done(self, stage: Stage[Any]) -> bool:
        return stage.name in self.stages and all((self.run_dir / path).exists() for path in stage.outputs)

    def record(self, stage: str, note: Note, seconds: float) -> None:
        self.stages[stage] = {**note, "seconds": seconds}
        self.save()

    def seconds(self) -> dict[str, float]:
        return {name: float(entry.get("seconds", 0.0)) for name, entry in self.stages.items()}

    def save(self) -> None:
        atomic_write_json(self.path, {"format": RUN_FORMAT, "parameters": self.parameters, "stages": self.stages})

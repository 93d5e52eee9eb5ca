"""What a run records: its evaluations and steps, as `metrics.csv`, `steps.csv` and `metrics.json`.

All three are rewritten atomically after every evaluation; `metrics.json` says whether the run is
complete and under which fingerprint (what its curve depends on), so a finished run is never
trained again and another configuration's directory is refused rather than resumed.
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from models.distill.recipe import DistillError, DistillRecipe
from models.distill.train import StepStats
from models.io.atomic import atomic_write_text
from models.layouts.layout import Layout
from models.schedules.grammar import ScheduleSpec, dtp_spec

RUN_FORMAT = "dtp-layout-distill-run/1"
METRIC_COLUMNS = ("layout", "seed", "step", "kl", "ppl", "loss", "lr")
STEP_COLUMNS = ("step", "loss", "kl", "ce", "grad_norm", "lr")


@dataclass(frozen=True)
class EvalRecord:
    """One evaluation of one run: what `metrics.csv` holds per row (plus timing)."""

    layout: str
    seed: int
    step: int  # optimiser steps taken before this evaluation
    kl: float
    ppl: float
    loss: float | None  # mean training loss over the steps since the previous evaluation
    lr: float  # lr of the last step taken (of step 0 at step 0)
    tokens: int  # training tokens seen
    elapsed_s: float  # wall seconds of this run so far (across resumes)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class RunState:
    """Where a run is: what a checkpoint saves and the logs show."""

    step: int = 0
    records: list[EvalRecord] = field(default_factory=list)
    steps: list[StepStats] = field(default_factory=list)
    elapsed: float = 0.0


def csv_text(columns: Sequence[str], rows: Sequence[dict[str, Any]]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(columns), extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: ("" if row.get(k) is None else row[k]) for k in columns})
    return buf.getvalue()


def json_safe(value: Any) -> Any:
    """NaN/inf are not JSON: write them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def write_metrics(out_dir: Path, records: Sequence[EvalRecord]) -> None:
    """`metrics.csv` of these evaluations under out_dir."""
    atomic_write_text(out_dir / "metrics.csv", csv_text(METRIC_COLUMNS, [r.as_dict() for r in records]))


def write_logs(run_dir: Path, *, layout: Layout, seed: int, fingerprint: str, recipe: DistillRecipe,
               state: RunState, complete: bool, dense_ppl: float, schedule: ScheduleSpec | None = None) -> None:
    rows = [r.as_dict() for r in state.records]
    write_metrics(run_dir, state.records)
    atomic_write_text(run_dir / "steps.csv", csv_text(STEP_COLUMNS, [s.as_dict() for s in state.steps]))
    doc = {"format": RUN_FORMAT, "layout": layout.name, "seed": seed, "fingerprint": fingerprint,
           "devices": layout.devices, "delta": layout.delta, "schedule": str(schedule or dtp_spec(layout.delta)),
           "recipe": recipe.as_dict(), "dense_ppl": dense_ppl,
           "complete": complete, "records": rows}
    atomic_write_text(run_dir / "metrics.json", json.dumps(json_safe(doc), indent=1))


def read_complete(run_dir: Path, fingerprint: str) -> list[EvalRecord] | None:
    """The records of a finished run with this fingerprint, else None; refuses another run's directory."""
    try:
        doc = json.loads((run_dir / "metrics.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if doc.get("fingerprint") != fingerprint:
        raise DistillError(f"{run_dir} holds a run of a different configuration (layout, seed, recipe or data); "
                           "use another output directory or remove it (--overwrite)")
    if not doc.get("complete"):
        return None
    return [EvalRecord(**{**r, "loss": r.get("loss")}) for r in doc["records"]]

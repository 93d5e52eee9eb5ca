"""How well a rate-based ETA (elapsed · (1 − f) / f, what worker/monitor.py reports) predicts the rest of a
distillation, for the fraction it had (steps done / steps) and the one it has (token passes,
`models.distill.run.RunWork`): one tiny run (tests/tiny.py's qwen2, 20 steps of 4 × 64 tokens, 64 × 64
evaluation tokens every 5 steps), timed, each fraction's ETA compared with the time that was really left.

    .venv/bin/python bench/distill_eta.py

Prints the run's length, when each fraction first moved, and the worst ETA error past 10 % as a share of
the run. One run on a CPU: the tiny model's cost split (small vocabulary, per-call overhead) is not
SmolLM2's; the figure says whether the bar tracks the work, not how close a real job's ETA is.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from models import distill as D
from models.data.calibration import CalibrationSpec
from models.schedules.grammar import dtp_spec
from tests.models.distill.kit import VOCAB, recipe
from tests.tiny import tiny_model

STEPS = 20


def worst_eta_error(points: list[tuple[float, float]], end: float) -> float:
    """max |ETA − time left| / run length over the reports with 10 % ≤ f < 100 %."""
    return max(abs(at * (1 - f) / f - (end - at)) / end for at, f in points if 0.1 <= f < 1)


def main() -> None:
    tmp = Path(tempfile.mkdtemp())
    np.save(tmp / "ids.npy", np.random.default_rng(0).integers(0, VOCAB, size=400 * 64))
    spec = D.DistillSpec(layouts=("contiguous",), devices=2, schedule=dtp_spec(1), seeds=(0,),
                         recipe=recipe(steps=STEPS, eval_every=5, batch_size=4, eval_batch_size=4),
                         train=CalibrationSpec(str(tmp / "ids.npy"), sequences=80, seq_len=64),
                         eval=CalibrationSpec(str(tmp / "ids.npy"), sequences=64, seq_len=64))
    t0 = time.perf_counter()
    passes: list[tuple[float, float]] = []
    steps: list[tuple[float, float]] = []
    D.run_distill(spec, teacher=tiny_model("qwen2"), tokenizer=None, out_dir=tmp / "out", plot=False,
                  progress=lambda _stage, f: passes.append((time.perf_counter() - t0, f)),
                  on_step=lambda _n, _s, stats, _l: steps.append((time.perf_counter() - t0, (stats.step + 1) / STEPS)))
    end = time.perf_counter() - t0
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"run {end:.1f} s (load average {load}); first report at {passes[0][0]:.1f} s (token passes) vs "
          f"{steps[0][0]:.1f} s (steps); worst ETA error past 10 %: token passes "
          f"{worst_eta_error(passes, end):.0%}, steps {worst_eta_error(steps, end):.0%} of the run")


if __name__ == "__main__":
    main()

"""What a job's probe is (its candidates, steps, held-out blocks and time budget), the recipe each candidate
is distilled with, and its cost in tokens. Torch-free: the API's budget check and the CLI's plan read it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from models.distill.recipe import DistillRecipe

MAX_CANDIDATES = 8
# Sequences (of the calibration's seq_len) per probe step, and the recipe's lr: bench/schedule_experiment.py's
# short-run recipe (4 sequences a step, lr 1e-4 decaying to 1e-5, a tenth of the steps warming up), under which
# its 50- and 100-step verdicts were read.
PROBE_BATCH = 4
PROBE_LR = 1e-4
PROBE_EVALUATIONS = 4  # evaluations after step 0: the curve each candidate reports has 5 points (fewer if S < 4)


class ProbeError(ValueError):
    """A probe that cannot run as asked; `field` is the job spec field to blame."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class ProbeSpec:
    """The probe of a job: K candidates, S steps each, held-out blocks, the time budget in seconds."""

    candidates: int
    steps: int = 20
    eval_sequences: int = 16
    max_seconds: float = 3600.0
    seed: int = 0  # the training seed (the block order) every candidate is distilled with

    def __post_init__(self) -> None:
        if not 2 <= self.candidates <= MAX_CANDIDATES:
            raise ProbeError("probe", f"probe must be 0 (no probe) or 2 … {MAX_CANDIDATES} candidate layouts, got "
                                      f"{self.candidates}: a probe of one candidate would train it for nothing")
        for field, value, low in (("probe_steps", self.steps, 1), ("probe_eval_sequences", self.eval_sequences, 1),
                                  ("probe_max_seconds", self.max_seconds, 1)):
            if not value >= low:
                raise ProbeError(field, f"{field} must be ≥ {low}, got {value}")

    def check_calibration(self, sequences: int) -> None:
        """ProbeError naming calibration.sequences when the calibration blocks are fewer than one probe batch."""
        if sequences < PROBE_BATCH:
            raise ProbeError("calibration.sequences", f"the probe trains on batches of {PROBE_BATCH} calibration "
                                                      f"blocks: calibration.sequences must be ≥ {PROBE_BATCH} with a "
                                                      f"probe, got {sequences}")

    def recipe(self) -> DistillRecipe:
        """Every candidate's recipe: S steps of PROBE_BATCH sequences, evaluated at 0, about every S/4 and S."""
        return DistillRecipe(steps=self.steps, batch_size=PROBE_BATCH, micro_batch_size=PROBE_BATCH, lr=PROBE_LR,
                             min_lr=PROBE_LR / 10, warmup_steps=max(1, self.steps // 10),
                             eval_every=max(1, math.ceil(self.steps / PROBE_EVALUATIONS)),
                             checkpoint_every=self.steps + 1)  # only the last step: the probe is short

    def cost(self, seq_len: int) -> ProbeCost:
        return ProbeCost(candidates=self.candidates, steps=self.steps, batch_size=PROBE_BATCH, seq_len=seq_len,
                         eval_sequences=self.eval_sequences, evaluations=self.recipe().evaluations())


def probe_of(spec: Any) -> ProbeSpec | None:
    """A job spec's probe (app.core.schemas.jobs.JobSpec, or anything with its attributes); None: probe 0."""
    if not getattr(spec, "probe", 0):
        return None
    return ProbeSpec(candidates=spec.probe, steps=spec.probe_steps, eval_sequences=spec.probe_eval_sequences,
                     max_seconds=float(spec.probe_max_seconds))


@dataclass(frozen=True)
class ProbeCost:
    """What a probe trains and evaluates, in tokens: candidates × steps × batch × seq_len of training, and
    (candidates × evaluations + 1) × eval sequences × seq_len of evaluation (the dense model's once)."""

    candidates: int
    steps: int
    batch_size: int
    seq_len: int
    eval_sequences: int
    evaluations: int  # per candidate, step 0 included

    @property
    def training_tokens(self) -> int:
        return self.candidates * self.steps * self.batch_size * self.seq_len

    @property
    def eval_tokens(self) -> int:
        return (self.candidates * self.evaluations + 1) * self.eval_sequences * self.seq_len

    @property
    def tokens(self) -> int:
        return self.training_tokens + self.eval_tokens

    def describe(self) -> str:
        return (f"{self.candidates} candidates × {self.steps} steps × {self.batch_size} × {self.seq_len} tokens = "
                f"{self.training_tokens:,} training tokens, and {self.evaluations} evaluations each of "
                f"{self.eval_sequences} × {self.seq_len} held-out tokens ({self.eval_tokens:,} with the dense "
                f"model's)")

    def as_dict(self) -> dict[str, Any]:
        return {"candidates": self.candidates, "steps": self.steps, "batch_size": self.batch_size,
                "seq_len": self.seq_len, "eval_sequences": self.eval_sequences, "evaluations": self.evaluations,
                "training_tokens": self.training_tokens, "eval_tokens": self.eval_tokens}

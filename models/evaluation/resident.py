"""The evaluation's names as callers have imported them from here; there is one evaluation,
`models.evaluation.evaluate`, for a model in memory or streamed layer by layer."""

from __future__ import annotations

from models.evaluation.evaluate import (
    LOGIT_CHUNK,
    EvalResult,
    eval_result,
    evaluate,
    schedule_spec,
)
from models.run.progress import Progress

__all__ = ["LOGIT_CHUNK", "EvalResult", "Progress", "eval_result", "evaluate", "schedule_spec"]

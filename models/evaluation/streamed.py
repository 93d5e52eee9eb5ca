"""`streamed_evaluate`: the name the streamed evaluation had, kept for its callers. There is one evaluation,
`models.evaluation.evaluate.evaluate`, which a `StreamedModel` feeds layer by layer
(`models.streaming.pipelines.by_layer`)."""

from __future__ import annotations

from models.evaluation.evaluate import evaluate as streamed_evaluate

__all__ = ["streamed_evaluate"]

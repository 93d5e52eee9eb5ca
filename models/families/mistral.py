"""Mistral: the Llama layout; refused when a sliding window can mask anything."""

from typing import Any

from models.families.base import Family
from models.families.plan import LLAMA_PLAN


def _check(config: Any) -> str | None:
    window = getattr(config, "sliding_window", None)
    # A window at least as long as the context never masks anything: that model is full attention.
    if window is not None and window < config.max_position_embeddings:
        return (
            f"sliding_window={window} < max_position_embeddings={config.max_position_embeddings} "
            "(sliding-window attention)"
        )
    return None


FAMILY = Family(name="mistral", model_types=("mistral",), plan=LLAMA_PLAN, extra_check=_check)

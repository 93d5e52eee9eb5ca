"""Qwen3: the Llama layout with per-head RMSNorm on q and k (one gain shared by all heads)."""

from typing import Any

from models.families.base import Family
from models.families.plan import LLAMA_PLAN


def _check(config: Any) -> str | None:
    if getattr(config, "attention_bias", False):
        return "attention_bias=True (it also puts a bias on o_proj, which has no owning device under DTP)"
    return None


FAMILY = Family(name="qwen3", model_types=("qwen3",), plan=LLAMA_PLAN, qk_norm=True, extra_check=_check)

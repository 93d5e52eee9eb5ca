"""Llama (SmolLM2, TinyLlama, Danube3): the reference module layout."""

from typing import Any

from models.families.base import Family
from models.families.plan import LLAMA_PLAN


def _check(config: Any) -> str | None:
    if getattr(config, "attention_bias", False):
        return "attention_bias=True (it also puts a bias on o_proj, which has no owning device under DTP)"
    return None


FAMILY = Family(name="llama", model_types=("llama",), plan=LLAMA_PLAN, extra_check=_check)

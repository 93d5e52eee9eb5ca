"""Qwen2 / Qwen2.5: the Llama layout with biases on q/k/v (their rows move with the group)."""

from models.families.base import Family
from models.families.plan import LLAMA_PLAN

FAMILY = Family(name="qwen2", model_types=("qwen2",), plan=LLAMA_PLAN)

"""What each family's config holds when a field is left out: the defaults its transformers config class
fills in (each family's `config_defaults`, declared in its module), so that the torch-free checks (the
API's parameter limit, the layout and memory checks) see the model the worker will build, not a model
with holes in it. Leaving out `intermediate_size` builds an FFN of 11,008 (llama); a check that skipped
the missing field would let a 181-byte config.json through to a 34 B-parameter load.

    full = with_family_defaults({"model_type": "llama", "hidden_size": 64, ...})
    parameter_count(full)  # the count of the model transformers builds from the same config

Two fields are derived, not constant, where a class derives them: `num_key_value_heads` None means
the attention heads (llama; an *omitted* one is 8 in mistral, 32 in qwen2/qwen3, as those classes
declare), `head_dim` None means hidden_size // num_attention_heads (qwen3's is 128 whatever the width).
tests/models/test_family_defaults.py checks each record's defaults against its config class and the count
against a model built on the meta device.
"""

from __future__ import annotations

from typing import Any, TypeGuard

from models.families.registry import find_family


def with_family_defaults(config: dict[str, Any]) -> dict[str, Any]:
    """`config` with every field its family's class would fill in that it leaves out (a field given as
    null stays null: the class derives those); unchanged for a model type outside the registry."""
    family = find_family(config.get("model_type"))
    if family is None:
        return config
    # a field saved under its alias is given (the field itself wins where a config has both)
    given = {**{field: config[alias] for alias, field in family.config_aliases.items() if alias in config}, **config}
    return {**{k: v for k, v in family.config_defaults.items() if k not in given}, **given}


def _int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def parameter_count(config: dict[str, Any]) -> int | None:
    """Parameters of the model a family builds from `config` (its defaults filled in first): embeddings,
    attention (with qwen2's q/k/v biases and qwen3's q/k norms), the SwiGLU FFN (an MoE family's: every
    expert, and the router), two norms per layer, the final norm, and an lm_head unless tied. None when a
    dimension is not a positive integer."""
    config = with_family_defaults(config)
    dims = [config.get(k) for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")]
    groups = config.get("num_key_value_heads")
    dims.append(dims[2] if groups is None else groups)
    vocab = config.get("vocab_size") or 0
    if not all(_int(v) and v >= 1 for v in dims) or not _int(vocab):
        return None
    hidden, layers, heads, width, groups = (int(v) for v in dims if v is not None)
    head_dim = config.get("head_dim") or hidden // heads
    if not _int(head_dim):
        return None
    attention = hidden * heads * head_dim * 2 + hidden * groups * head_dim * 2  # q, o; k, v
    family = find_family(config.get("model_type"))
    if family is not None and family.qkv_bias:
        attention += heads * head_dim + 2 * groups * head_dim
    if family is not None and family.qk_norm:
        attention += 2 * head_dim
    ffn = 3 * hidden * width  # gate, up, down
    if family is not None and family.moe is not None:  # E experts of I_e neurons, and the router [E, D]
        experts, size = config.get(family.moe.num_experts_field), config.get(family.moe.expert_size_field)
        if not (_int(experts) and experts >= 1 and _int(size) and size >= 1):
            return None
        ffn = experts * 3 * hidden * size + experts * hidden
    per_layer = attention + ffn + 2 * hidden  # two norms
    embeddings = vocab * hidden * (1 if config.get("tie_word_embeddings") else 2)
    return layers * per_layer + embeddings + hidden

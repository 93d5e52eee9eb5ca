"""What each family's config holds when a field is left out: the defaults its transformers config class
fills in, declared once here so that the torch-free checks (the API's parameter limit, the layout and
memory checks) see the model the worker will build, not a model with holes in it. Leaving out
`intermediate_size` builds an FFN of 11,008 (llama); a check that skipped the missing field would let
a 181-byte config.json through to a 34 B-parameter load.

    full = with_family_defaults({"model_type": "llama", "hidden_size": 64, ...})
    parameter_count(full)  # the count of the model transformers builds from the same config

Two fields are derived, not constant, where a class derives them: `num_key_value_heads` None means
the attention heads (llama; an *omitted* one is 8 in mistral, 32 in qwen2/qwen3, as those classes
declare), `head_dim` None means hidden_size // num_attention_heads (qwen3's is 128 whatever the width).
tests/models/test_family_defaults.py checks the table against the config classes and the count
against a model built on the meta device.
"""

from __future__ import annotations

from typing import Any, TypeGuard

_LLAMA_LIKE: dict[str, Any] = {
    "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": None, "head_dim": None, "max_position_embeddings": 2048,
    "tie_word_embeddings": False, "hidden_act": "silu",
}

FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {**_LLAMA_LIKE, "attention_bias": False, "mlp_bias": False},
    "mistral": {**_LLAMA_LIKE, "intermediate_size": 14336, "num_key_value_heads": 8,
                "max_position_embeddings": 131072, "sliding_window": 4096},
    "qwen2": {**_LLAMA_LIKE, "vocab_size": 151936, "intermediate_size": 22016, "num_key_value_heads": 32,
              "max_position_embeddings": 32768, "use_sliding_window": False},
    "qwen3": {**_LLAMA_LIKE, "vocab_size": 151936, "intermediate_size": 22016, "num_key_value_heads": 32,
              "head_dim": 128, "max_position_embeddings": 32768, "use_sliding_window": False,
              "attention_bias": False},
}
# Per layer, besides the llama layout's weights: biases on q, k and v (qwen2's are always there); one
# RMSNorm gain of head_dim on q and one on k (qwen3).
QKV_BIAS = frozenset({"qwen2"})
QK_NORM = frozenset({"qwen3"})


def with_family_defaults(config: dict[str, Any]) -> dict[str, Any]:
    """`config` with every field its family's class would fill in that it leaves out (a field given as
    null stays null: the class derives those); unchanged for a model type outside the table."""
    defaults = FAMILY_DEFAULTS.get(str(config.get("model_type")))
    if defaults is None:
        return config
    return {**{k: v for k, v in defaults.items() if k not in config}, **config}


def _int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def parameter_count(config: dict[str, Any]) -> int | None:
    """Parameters of the model a family builds from `config` (its defaults filled in first): embeddings,
    attention (with qwen2's q/k/v biases and qwen3's q/k norms), the SwiGLU FFN, two norms per layer, the
    final norm, and an lm_head unless tied. None when a dimension is not a positive integer."""
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
    model_type = config.get("model_type")
    if model_type in QKV_BIAS:
        attention += heads * head_dim + 2 * groups * head_dim
    if model_type in QK_NORM:
        attention += 2 * head_dim
    per_layer = attention + 3 * hidden * width + 2 * hidden  # + gate, up, down; two norms
    embeddings = vocab * hidden * (1 if config.get("tie_word_embeddings") else 2)
    return layers * per_layer + embeddings + hidden

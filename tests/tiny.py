"""Tiny random models of every supported family, CPU fp32, for parity tests."""

from __future__ import annotations

import copy
import functools
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

BASE: dict[str, Any] = dict(
    vocab_size=97,
    hidden_size=48,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)

# Each case exercises one family feature: GQA, q/k/v biases, per-head q/k norms, explicit head_dim,
# tied embeddings.
FAMILY_CASES: dict[str, dict[str, Any]] = {
    "llama": dict(model_type="llama"),
    "llama-tied-headdim": dict(model_type="llama", head_dim=8, tie_word_embeddings=True),
    "mistral": dict(model_type="mistral", sliding_window=None),
    "qwen2": dict(model_type="qwen2"),
    "qwen3": dict(model_type="qwen3", head_dim=16),
}

# Mixture-of-experts families (issue 46), kept apart from FAMILY_CASES (which the dense tests walk): top-2 of
# 8 experts without renormalising (qwen3_moe's default) and of 4 experts renormalised (mixtral's only way),
# one expert 24 neurons wide (L ∈ {1, 2, 4} divide it and the 4 KV groups), head_dim 32 (vLLM's CPU attention).
MOE_CASES: dict[str, dict[str, Any]] = {
    "qwen3_moe": dict(model_type="qwen3_moe", hidden_size=64, head_dim=32, num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=24, norm_topk_prob=False),
    "mixtral": dict(model_type="mixtral", hidden_size=64, head_dim=32, num_local_experts=4, num_experts_per_tok=2,
                    intermediate_size=24, sliding_window=None),
}


def tiny_config(case: str = "llama", **overrides: Any) -> Any:
    kwargs = {**BASE, **{**FAMILY_CASES, **MOE_CASES}[case], **overrides}
    model_type = kwargs.pop("model_type")
    return AutoConfig.for_model(model_type, **kwargs)


def tiny_model(case: str = "llama", seed: int = 0, **overrides: Any) -> PreTrainedModel:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(case, **overrides), dtype=torch.float32)
    # Random init gives tiny weights and near-uniform logits; widen them so that mistakes show.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif p.ndim == 1:
                p.normal_(0.0, 0.1)
            else:
                p.normal_(0.0, 1.0 / p.shape[-1] ** 0.5)
    return model.eval()


def tokens(batch: int = 2, seq: int = 12, vocab: int = 97, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=g)


@functools.cache
def _cached_tiny_model(case: str) -> PreTrainedModel:
    return tiny_model(case)


def fresh(case: str) -> PreTrainedModel:
    """A private copy of the case's seed-0 tiny model (built once per session, then deep-copied)."""
    return copy.deepcopy(_cached_tiny_model(case))


# L = 3 needs a KV-group count that 3 divides (the FFN width, 96, already is): 6 query heads, 3 KV groups.
THREE_WAY: dict[str, Any] = dict(num_attention_heads=6, num_key_value_heads=3)


@functools.cache
def _cached_three_way(case: str) -> PreTrainedModel:
    return tiny_model(case, **THREE_WAY)


def fresh_for_devices(case: str, devices: int) -> PreTrainedModel:
    """A private copy of a seed-0 tiny model of the case that L = `devices` can shard: the case's own
    (4 KV groups) for L ∈ {1, 2, 4}, its THREE_WAY variant (3 KV groups) for L = 3."""
    if devices == 3:
        return copy.deepcopy(_cached_three_way(case))
    return fresh(case)


def byte_tokenizer() -> Any:
    """A tokenizer for any text without training one: byte-level, one token per byte (ids 0-255), no merges,
    and `</s>` (256) as EOS, so a tiny model with vocab_size 257 can read the corpora."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {symbol: i for i, symbol in enumerate(alphabet)} | {"</s>": len(alphabet)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="</s>")


def backtracking_tokenizer() -> Any:
    """`byte_tokenizer` whose pre-tokenizer first splits on `b*b*\\d`: on a line of n `b`s and no digit the
    regex engine backtracks through O(n³) steps (2,000 `b`s: ~17 s of CPU a line on this machine), without
    the panic that gives up on a runaway match: a tokenizer that is slow, not broken, on hostile text."""
    from tokenizers import Regex, pre_tokenizers

    tokenizer = byte_tokenizer()
    backend = tokenizer.backend_tokenizer
    backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r"b*b*\d"), behavior="isolated"),
                                                     backend.pre_tokenizer])
    return tokenizer


# Q4_1 (the packaged SmolLM2's type) packs rows in blocks of 32: the widths are multiples of it.
GGUF_TINY = dict(hidden_size=64, intermediate_size=128, vocab_size=96)


def tiny_gguf(path: Any, *, seed: int = 0, quantization: str = "Q4_1") -> PreTrainedModel:
    """Write a tiny llama as a GGUF file the way llama.cpp's converter does (its tensor names, q/k rows
    permuted for its rotary layout, 2-D weights quantised, norms in F32, no tokenizer) and return the
    model it was made from. Loading the file dequantises it: equal to the model up to the quantisation
    error (exactly equal with quantization="F32")."""
    import gguf
    import numpy as np

    model = tiny_model("llama", seed=seed, **GGUF_TINY)
    config = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    qtype = gguf.GGMLQuantizationType[quantization]

    def rotary_rows(w: Any, heads: int) -> Any:  # llama.cpp's permute: per head, halves → interleaved pairs
        return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    for name, tensor in model.state_dict().items():
        w = tensor.numpy()
        if name.endswith("q_proj.weight"):
            w = rotary_rows(w, config.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            w = rotary_rows(w, config.num_key_value_heads)
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if w.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, w.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model

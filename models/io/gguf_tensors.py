"""A GGUF file's tensor table checked against its own config before any loader sees it: every tensor a
name the model's family has (llama.cpp's names for a pre-norm RMSNorm decoder with grouped-query
attention), a shape the config's dimensions give, a ggml type with a known block size, and a byte range
inside the file. transformers' GGUF loader dequantises every tensor of the table to float32 before it
drops the ones it has no name for (issue 41: an extra 2^28-element Q2_K tensor of 88 MB cost the worker
+1.7 GB), so a tensor outside the layout is refused here, not skipped there; with every shape fixed by
the config, what the loader allocates is what the config's parameter count (MAX_MODEL_PARAMS) allows.

    header = read_header(data, file_size=size, limits=limits)
    config = checked_config(header, file_size=size)   # GGUFError naming the first wrong tensor

Standard library only (the API reads tenants' GGUF uploads with it).
"""

from __future__ import annotations

import re
from typing import Any

from models.io.gguf_header import GGUFError, GGUFHeader, GGUFTensor

# ggml type id → (name, elements per block, bytes per block): ggml's ggml.c type traits (gguf-py's
# GGML_QUANT_SIZES, checked against it in tests/models/test_gguf_tensors.py).
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40), 10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98), 19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110), 22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136),
    28: ("F64", 1, 8), 29: ("IQ1_M", 256, 56), 30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66),
}
_BLOCK = re.compile(r"blk\.(\d{1,6})\.(.+)")


def _dims(config: dict[str, Any]) -> dict[str, int]:
    """The dimensions a tensor's shape is made of, from the config the header states."""
    need = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
    missing = [name for name in need if not isinstance(config.get(name), int) or config[name] < 1]
    if missing:
        raise GGUFError(f"its tensor table cannot be checked: its metadata states no {', '.join(missing)}")
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    kv = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    return {"H": hidden, "V": config["vocab_size"], "I": config["intermediate_size"], "Q": heads * head_dim,
            "KV": kv * head_dim, "D": head_dim, "L": config["num_hidden_layers"]}


class Layout:
    """The tensors a config has, looked up by name: never listed out, so a header declaring 2^40 layers
    costs what its tensor table holds (at most GGUF_MAX_TENSORS), not what it declares. Optional: the
    output matrix (absent when tied to the embedding), rope_freqs (llama 3's scaled rotary), q/k norms
    (qwen3), biases (qwen2's q/k/v; attention_bias, mlp_bias)."""

    def __init__(self, config: dict[str, Any]) -> None:
        d = _dims(config)
        H, I, Q, KV = d["H"], d["I"], d["Q"], d["KV"]
        self.layers = d["L"]
        self.top = {"token_embd.weight": (H, d["V"]), "output.weight": (H, d["V"]), "output_norm.weight": (H,),
                    "rope_freqs.weight": (d["D"] // 2,)}
        self.top_required = ("token_embd.weight", "output_norm.weight")
        self.block_required = {"attn_norm.weight": (H,), "ffn_norm.weight": (H,),
                               "attn_q.weight": (H, Q), "attn_k.weight": (H, KV), "attn_v.weight": (H, KV),
                               "attn_output.weight": (Q, H), "ffn_gate.weight": (H, I), "ffn_up.weight": (H, I),
                               "ffn_down.weight": (I, H)}
        self.block = self.block_required | {
            "attn_q.bias": (Q,), "attn_k.bias": (KV,), "attn_v.bias": (KV,), "attn_output.bias": (H,),
            "attn_q_norm.weight": (d["D"],), "attn_k_norm.weight": (d["D"],), "ffn_gate.bias": (I,),
            "ffn_up.bias": (I,), "ffn_down.bias": (H,)}

    def shape(self, name: str) -> tuple[int, ...] | None:
        """The tensor's shape in ggml order, or None when the layout has no tensor of that name."""
        match = _BLOCK.fullmatch(name)
        if match is None:
            return self.top.get(name)
        layer, suffix = match.groups()
        return self.block.get(suffix) if str(int(layer)) == layer and int(layer) < self.layers else None

    def first_missing(self, seen: set[str]) -> str | None:
        """The first required tensor not in `seen` (found within len(seen) / 9 + 1 layers)."""
        for name in self.top_required:
            if name not in seen:
                return name
        for layer in range(self.layers):
            for suffix in self.block_required:
                if f"blk.{layer}.{suffix}" not in seen:
                    return f"blk.{layer}.{suffix}"
        return None


def tensor_bytes(tensor: GGUFTensor) -> int:
    """Bytes of the tensor's data in the file (its type's blocks); GGUFError for a type not in GGML_TYPES
    or a row that is not whole blocks."""
    if tensor.type not in GGML_TYPES:
        raise GGUFError(f"tensor {tensor.name[:100]!r} has ggml type {tensor.type}, not one this server reads")
    kind, block, size = GGML_TYPES[tensor.type]
    if tensor.dims[0] % block:
        raise GGUFError(f"tensor {tensor.name[:100]!r}: a {kind} row of {tensor.dims[0]} elements is not whole "
                        f"blocks of {block}")
    elements = 1
    for n in tensor.dims:
        elements *= n
    return elements // block * size


def check_tensor_table(header: GGUFHeader, config: dict[str, Any], *, file_size: int) -> None:
    """Every tensor named, shaped and typed as the config says, its bytes inside the file, none twice and
    none missing; GGUFError naming the first that is not (module docstring)."""
    layout = Layout(config)
    seen: set[str] = set()
    data = file_size - header.data_start
    for tensor in header.tensors:
        name = tensor.name
        shape = layout.shape(name)
        if shape is None:
            raise GGUFError(f"tensor {name[:100]!r} is not one a {config.get('model_type')} model of "
                            f"{config['num_hidden_layers']} layers has (the loader would dequantise it before "
                            "dropping it)")
        if name in seen:
            raise GGUFError(f"tensor {name[:100]!r} is in its tensor table twice")
        seen.add(name)
        if tensor.dims != shape:
            raise GGUFError(f"tensor {name!r} has shape {list(tensor.dims)} (ggml order); its config gives "
                            f"{list(shape)}")
        if not 0 <= tensor.offset <= tensor.offset + tensor_bytes(tensor) <= data:
            raise GGUFError(f"tensor {name!r}: its {tensor_bytes(tensor)} bytes at offset {tensor.offset} are not "
                            f"inside the file's {max(data, 0)} bytes of tensor data")
    if (missing := layout.first_missing(seen)) is not None:
        raise GGUFError(f"its tensor table lacks tensor {missing!r}, which its config needs")


def checked_config(header: GGUFHeader, *, file_size: int) -> dict[str, Any]:
    """The header's config (GGUFHeader.config) once its tensor table agrees with it."""
    config = header.config()
    check_tensor_table(header, config, file_size=file_size)
    return config

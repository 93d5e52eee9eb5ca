"""A synthetic Llama-shaped checkpoint of any size, random weights, written tensor by tensor with
`models.streaming.safetensors_reader.SafetensorsWriter` (one tensor in memory at a time: making a checkpoint of a
few GB needs a few MB), in files of at most 2 GB with the index `save_pretrained` writes.

    python -m bench.synthetic_checkpoint OUT --hidden 2048 --intermediate 5632 --layers 24
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig

from models.export.writer import DEFAULT_SHARD_BYTES, SAFE_INDEX, _file_groups
from models.streaming.layer_source import checkpoint_names
from models.streaming.safetensors_reader import SafetensorsWriter


def llama_config(*, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, vocab: int) -> Any:
    return AutoConfig.for_model("llama", hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                                num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
                                max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False)


def _random(name: str, shape: tuple[int, ...], generator: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """Norm gains near 1, matrices with unit-variance outputs (so activations stay in range)."""
    if len(shape) == 1:
        return (1.0 + 0.1 * torch.randn(shape, generator=generator)).to(dtype)
    return (torch.randn(shape, generator=generator) / shape[-1] ** 0.5).to(dtype)


def write_checkpoint(out: Path, config: Any, *, dtype: torch.dtype = torch.float32, seed: int = 0,
                     max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> int:
    """Write config.json and the weights under `out`; returns the weight bytes."""
    out.mkdir(parents=True, exist_ok=True)
    config.dtype = str(dtype).removeprefix("torch.")
    config.save_pretrained(out)
    names = checkpoint_names(config, dtype)
    item = torch.empty((), dtype=dtype).element_size()
    sizes = [item * int(torch.Size(s).numel()) for _, s in names]
    groups = _file_groups(sizes, max_shard_bytes)
    files = ["model.safetensors"] if len(groups) == 1 else [
        f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors" for k in range(len(groups))]
    generator = torch.Generator().manual_seed(seed)
    weight_map = {}
    for file, group in zip(files, groups, strict=True):
        writer = SafetensorsWriter(out / file, [(names[k][0], dtype, names[k][1]) for k in group],
                                   metadata={"format": "pt"})
        for k in group:
            writer.write(names[k][0], _random(names[k][0], names[k][1], generator, dtype))
            weight_map[names[k][0]] = file
        writer.close()
    if len(files) > 1:
        (out / SAFE_INDEX).write_text(json.dumps({"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map},
                                                 indent=2))
    return sum(sizes)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    args = p.parse_args()
    config = llama_config(hidden=args.hidden, intermediate=args.intermediate, layers=args.layers, heads=args.heads,
                          kv_heads=args.kv_heads, vocab=args.vocab)
    print(f"{write_checkpoint(args.out, config) / 2**30:.2f} GiB of weights in {args.out}")


if __name__ == "__main__":
    main()

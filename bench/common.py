"""Shared bench helpers: model shapes of the paper and an interleaved timer."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

# Qwen3-0.6B's dimensions (28 layers in the real model; the benches use fewer).
QWEN3_06B = dict(
    vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_attention_heads=16,
    num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6, max_position_embeddings=40960,
    tie_word_embeddings=True, rope_theta=1_000_000.0,
)


def qwen3_06b_shaped(num_layers: int = 4, seed: int = 0, *, dtype: torch.dtype = torch.float32,
                     device: str | torch.device = "cpu", **overrides: Any) -> PreTrainedModel:
    """A random model of Qwen3-0.6B's shape (`overrides` change its dimensions), built on `device`."""
    torch.manual_seed(seed)
    config = AutoConfig.for_model("qwen3", num_hidden_layers=num_layers, **{**QWEN3_06B, **overrides})
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def interleaved_times(fns: dict[str, Callable[[], object]], repeats: int = 5, warmup: int = 1,
                      sync: Callable[[], object] | None = None) -> dict[str, float]:
    """Median wall time of each function, run in turn so that machine noise hits all alike.

    sync (e.g. torch.cuda.synchronize) runs before each clock read: device work is asynchronous.
    """
    def wait() -> None:
        if sync is not None:
            sync()

    for _ in range(warmup):
        for fn in fns.values():
            fn()
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            wait()
            t0 = time.perf_counter()
            fn()
            wait()
            samples[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in samples.items()}


def dtp_vs_dense_times(model: PreTrainedModel, ids: torch.Tensor, *, devices: int, delta: int, repeats: int,
                       sync: Callable[[], object] | None = None) -> dict[str, float]:
    """Median seconds of the dense HF forward and the DTP simulator's on `ids` [B, S], with and without
    the LM head (`dense`, `dtp`, `dense_layers`, `dtp_layers`), interleaved, under inference mode."""
    from models.sim.dtp import DTPModel

    dtp = DTPModel(model, devices=devices, delta=delta).eval()
    with torch.inference_mode():
        return interleaved_times({
            "dense": lambda: model(ids).logits,
            "dtp": lambda: dtp(ids),
            "dense_layers": lambda: model.model(ids).last_hidden_state,
            "dtp_layers": lambda: dtp.hidden_states(ids),
        }, repeats=repeats, sync=sync)


def add_shape_args(ap: argparse.ArgumentParser, *, repeats: int) -> None:
    """The flags every model-shaped bench shares: layers, batch × seq tokens, L, δ, repeats."""
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--delta", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=repeats)

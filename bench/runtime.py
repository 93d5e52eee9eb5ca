"""Decode ms/token and time blocked in communication: tensor parallelism (δ=0) vs DTP (δ=1, 2).

The multi-process runtime (`models.runtime`) on rank shards of a SmolLM2-135M-shaped random model
(random weights, the real shape: 30 layers, 9 query / 3 KV heads, FFN 1536, vocabulary 49152),
L=3 ranks, gloo, one torch thread per rank. Each collective's result becomes usable X µs after it
completed (`link_latency_us`), X ∈ {0, 100, 500}: standard TP waits for every module's all-reduce
at once and pays X 2N times per token; DTP starts each exchange right after the module and waits δ
modules later, so compute covers X where it can. Both pay it on the final reduction and the token
broadcast.

This is an emulation on CPU: the ranks are processes on one machine sharing its cores (three ranks
on the 2-core dev machine are oversubscribed), gloo goes through the loopback interface, and the
latency is a sleep. The ratios, measured in one run with the variants interleaved, are what it
shows. On a machine with one GPU per rank, run it with `--backend nccl` (not run here: no GPU).

    .venv/bin/python bench/runtime.py [--layers 30 --devices 3 --prompt 16 --tokens 32 --repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from models.export import export_rank_shards, permuted_copy
from models.families import model_shape
from models.layouts import layout as lay
from models.runtime import DTPRuntime

# SmolLM2-135M's dimensions (HuggingFaceTB/SmolLM2-135M config).
SMOLLM2_135M = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
    head_dim=64, rms_norm_eps=1e-5, max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True,
)
LATENCIES_US = (0.0, 100.0, 500.0)
DELTAS = (0, 1, 2)


def smollm2_shaped(num_layers: int, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = AutoConfig.for_model("llama", num_hidden_layers=num_layers, **SMOLLM2_135M)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--devices", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    ap.add_argument("--tokens", type=int, default=32, help="generated tokens per run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args = ap.parse_args()

    model = smollm2_shaped(args.layers)
    layout = lay.random(model_shape(model.config), args.devices, 1, seed=1000)
    ids = torch.randint(0, model.config.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(0))
    runs: dict[tuple[float, int], list[tuple[float, float, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        shards = export_rank_shards(permuted_copy(model, layout), layout, Path(tmp) / "shards")
        del model
        with DTPRuntime.start(shards, backend=args.backend, threads=args.threads, timeout_s=120.0) as rt:
            rt.generate(ids.numpy(), max_new_tokens=4, stop_at_eos=False)  # warm-up
            for _ in range(args.repeats):
                for latency in LATENCIES_US:
                    for delta in DELTAS:  # interleaved, so machine noise hits every variant alike
                        out = rt.generate(ids.numpy(), max_new_tokens=args.tokens, delta=delta, stop_at_eos=False,
                                          link_latency_us=latency)
                        ms = max(r.ms_per_token for r in out.ranks if r.ms_per_token is not None)
                        blocked = statistics.mean(r.blocked_ms_per_token or 0.0 for r in out.ranks)
                        exchange = statistics.mean(r.exchange_blocked_ms_per_token or 0.0 for r in out.ranks)
                        runs.setdefault((latency, delta), []).append((ms, blocked, exchange))

    def median(latency: float, delta: int, k: int) -> float:
        return statistics.median(r[k] for r in runs[(latency, delta)])

    print(f"SmolLM2-135M-shaped (random weights), {args.layers} layers, L={args.devices} ranks, {args.backend}, "
          f"{args.threads} thread(s)/rank, fp32 CPU, prompt {args.prompt}, {args.tokens} tokens, "
          f"median of {args.repeats}")
    print("decode ms/token (blocked ms/token: all waits | module exchanges only)")
    header = f"{'link latency':>13}" + "".join(f"{name:>30}" for name in ("TP (δ=0)", "DTP δ=1", "DTP δ=2"))
    print(header + f"{'TP/δ=1':>9}{'TP/δ=2':>9}")
    for latency in LATENCIES_US:
        cells = "".join(f"{median(latency, d, 0):>10.2f} ({median(latency, d, 1):6.2f} | {median(latency, d, 2):6.2f})"
                        for d in DELTAS)
        tp = median(latency, 0, 0)
        print(f"{latency:>10.0f} µs{cells}{tp / median(latency, 1, 0):>9.2f}{tp / median(latency, 2, 0):>9.2f}")
    n = 2 * args.layers
    print(f"collectives per token: TP {n} module all-reduces, DTP δ {n} - δ (the last δ partials are never "
          "folded in); both + 1 reduction to rank 0 + 1 token broadcast")


if __name__ == "__main__":  # the ranks' forkserver (or spawn) imports this module too
    main()

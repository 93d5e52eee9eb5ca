"""The affinity pass + optimiser at dtp:2 over dtp:1 (issue 20's J_σ), on the packaged SmolLM2-135M.

dtp:1 is the paper's chain (up and down edges); dtp:2 adds a KV → KV and a neuron → neuron edge per
layer pair, the latter I×I (1536×1536), computed from three [I, T] × [T, I] products per micro-batch and
kept sparse (its largest entries up to --edge-kept-mass of its mass) above the memory limit. Prints both
wall times (one run each, after one warm-up of the dense forward) and their ratio, and the neuron →
neuron edges' kept mass.

    .venv/bin/python bench/schedule_objective.py [--sequences 4 --seq-len 256 --devices 3 --restarts 0]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from models.affinity.edges import schedule_affinity_pass
from models.data.calibration import CalibrationSpec, load_blocks
from models.families import model_shape
from models.io.assets import smollm2_gguf
from models.io.loading import ModelSource, load_model, load_tokenizer
from models.optimise.edges import SparseEdge
from models.schedules.grammar import resolve_schedule
from models.variants.set import build_layouts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sequences", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--devices", type=int, default=3)
    ap.add_argument("--restarts", type=int, default=0)
    ap.add_argument("--edge-kept-mass", type=float, default=0.95)
    ap.add_argument("--edge-memory-limit", type=int, default=1 << 30)
    args = ap.parse_args()

    source = ModelSource(str(smollm2_gguf()))
    model, tokenizer = load_model(source), load_tokenizer(source)
    blocks = load_blocks(CalibrationSpec("corpus:kjv", sequences=args.sequences, seq_len=args.seq_len), tokenizer,
                         vocab_size=model.config.vocab_size)
    layers = model_shape(model.config).num_layers
    with torch.inference_mode():
        model.model(blocks[: args.batch_size])  # warm-up
    times: dict[str, dict[str, float]] = {}
    kept: list[float] = []
    for name in ("dtp:1", "dtp:2"):
        schedule = None if name == "dtp:1" else resolve_schedule(name, layers, args.devices)
        t0 = time.perf_counter()
        result = schedule_affinity_pass(model, blocks, batch_size=args.batch_size, schedule=schedule,
                               edge_memory_limit=args.edge_memory_limit, edge_kept_mass=args.edge_kept_mass)
        t1 = time.perf_counter()
        layouts = build_layouts(result, devices=args.devices, delta=int(name[-1]), restarts=args.restarts,
                                schedule=schedule)
        t2 = time.perf_counter()
        best, base = layouts["optimised"].score or {}, layouts["contiguous"].score or {}
        times[name] = {"affinity": t1 - t0, "optimise": t2 - t1, "J": best["J"], "bound": best["upper_bound"],
                       "contiguous": base["J"]}
        kept = [m.kept_mass for scores in result.edges.values() for m in scores.values() if isinstance(m, SparseEdge)]
    print(f"SmolLM2-135M (packaged GGUF), fp32 CPU, {torch.get_num_threads()} threads, {args.sequences}×{args.seq_len} "
          f"corpus:kjv tokens, L={args.devices}, restarts {args.restarts}")
    for name, t in times.items():
        print(f"{name}: affinity pass {t['affinity']:7.1f} s, optimiser {t['optimise']:6.2f} s, "
              f"J_σ optimised {t['J']:.3f} (contiguous {t['contiguous']:.3f}, bound {t['bound']:.3f})")
    one, two = times["dtp:1"], times["dtp:2"]
    both = (two["affinity"] + two["optimise"]) / (one["affinity"] + one["optimise"])
    print(f"ratio dtp:2 / dtp:1: affinity pass {two['affinity'] / one['affinity']:.2f}×, optimiser "
          f"{two['optimise'] / one['optimise']:.2f}×, both {both:.2f}×")
    if kept:
        print(f"neuron→neuron edges kept sparse (target {args.edge_kept_mass}): kept mass "
              f"{min(kept):.3f}..{max(kept):.3f} "
              f"(median {sorted(kept)[len(kept) // 2]:.3f})")


if __name__ == "__main__":
    main()

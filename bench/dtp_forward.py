"""DTP simulator forward time over dense HF forward time on the same tokens.

Qwen3-0.6B-shaped random model (4 layers), fp32 CPU, L=4, δ=1. Target: ratio ≤ 1.3.
Also prints the ratio without the LM head (the layers alone), where DTP's extra work shows most.

    .venv/bin/python bench/dtp_forward.py [--batch 1 --seq 512 --devices 4 --delta 1 --repeats 5]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import add_shape_args, dtp_vs_dense_times, qwen3_06b_shaped


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_args(ap, repeats=5)
    args = ap.parse_args()

    model = qwen3_06b_shaped(args.layers)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq))
    t = dtp_vs_dense_times(model, ids, devices=args.devices, delta=args.delta, repeats=args.repeats)
    print(f"Qwen3-0.6B-shaped, {args.layers} layers, fp32 CPU ({torch.get_num_threads()} threads), "
          f"L={args.devices}, δ={args.delta}, {args.batch}×{args.seq} tokens")
    print(f"dense forward        {t['dense'] * 1e3:9.1f} ms")
    print(f"DTP forward          {t['dtp'] * 1e3:9.1f} ms")
    print(f"ratio DTP/dense      {t['dtp'] / t['dense']:9.3f}   (target ≤ 1.3)")
    print(f"layers only: dense {t['dense_layers'] * 1e3:.1f} ms, DTP {t['dtp_layers'] * 1e3:.1f} ms, "
          f"ratio {t['dtp_layers'] / t['dense_layers']:.3f}")


if __name__ == "__main__":
    main()

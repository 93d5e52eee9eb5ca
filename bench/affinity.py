"""Affinity pass time over plain dense forward time on the same tokens.

Qwen3-0.6B-shaped random model (4 layers), fp32 CPU. Target: ratio ≤ 2.5 (the paper's way, per
head in hidden space, is about 4-8). The forward is the decoder stack without the LM head
(`model.model`), since the pass computes no logits; the ratio against the full forward is printed too.

    .venv/bin/python bench/affinity.py [--sequences 16 --seq-len 512 --batch-size 4 --token-chunk 128]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import interleaved_times, qwen3_06b_shaped
from models.affinity.scoring import affinity_pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--sequences", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--token-chunk", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    model = qwen3_06b_shaped(args.layers)
    blocks = torch.randint(0, model.config.vocab_size, (args.sequences, args.seq_len))

    def forward_layers() -> None:
        for start in range(0, args.sequences, args.batch_size):
            model.model(blocks[start : start + args.batch_size])

    def forward_full() -> None:
        for start in range(0, args.sequences, args.batch_size):
            model(blocks[start : start + args.batch_size])

    with torch.inference_mode():
        t = interleaved_times({
            "forward": forward_layers,
            "forward_full": forward_full,
            "affinity": lambda: affinity_pass(model, blocks, batch_size=args.batch_size,
                                              token_chunk=args.token_chunk),
        }, repeats=args.repeats)
    print(f"Qwen3-0.6B-shaped, {args.layers} layers, fp32 CPU ({torch.get_num_threads()} threads), "
          f"{args.sequences}×{args.seq_len} tokens, micro-batch {args.batch_size}, token chunk {args.token_chunk}")
    print(f"dense forward (layers)   {t['forward'] * 1e3:9.1f} ms")
    print(f"dense forward (+LM head) {t['forward_full'] * 1e3:9.1f} ms")
    print(f"affinity pass            {t['affinity'] * 1e3:9.1f} ms")
    print(f"ratio affinity/forward   {t['affinity'] / t['forward']:9.3f}   (target ≤ 2.5)")
    print(f"ratio vs full forward    {t['affinity'] / t['forward_full']:9.3f}")


if __name__ == "__main__":
    main()

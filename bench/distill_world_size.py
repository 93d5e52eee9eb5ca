"""Sharded distillation: the step time at W ranks (FSDP2, gloo on CPU / NCCL on GPUs) over W = 1.

A Llama-shaped random model (tests/tiny.py's family at a larger width), the same run at W = 1 and at
each W given: per optimiser step, the wall time on rank 0 between consecutive steps (evaluations left
out: the run evaluates only at step 0 and the last). Also checks that the losses agree (max |Δ|).

On a CPU the W ranks share the machine's cores: with 2 cores (and other load), W = 2 cannot be faster
than W = 1 by more than the cores allow, and the figure mostly shows the cost of FSDP's all-gathers
and reduce-scatters over gloo plus the extra processes. It says nothing about NCCL on GPUs, where each
rank has its own device (`make gpu-check` runs the W-GPU step).

    .venv/bin/python bench/distill_world_size.py [--world-sizes 2 --steps 12 --hidden 256 --layers 4 --seq 64]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from models import distill
from models.families import model_shape
from models.layouts import layout as lay


def make_teacher(hidden: int, layers: int, seed: int = 0) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", vocab_size=512, hidden_size=hidden, intermediate_size=2 * hidden,
                                  num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
                                  max_position_embeddings=1024, rms_norm_eps=1e-6, tie_word_embeddings=False)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def timed_run(world_size: int, args: argparse.Namespace) -> dict[str, Any]:
    teacher = make_teacher(args.hidden, args.layers)
    g = torch.Generator().manual_seed(1)
    train = torch.randint(0, 512, (args.batch * args.steps, args.seq), generator=g)  # [n, S]
    recipe = distill.DistillRecipe(steps=args.steps, batch_size=args.batch, micro_batch_size=args.batch,
                                   lr=1e-3, min_lr=1e-4, warmup_steps=1, eval_every=args.steps,
                                   checkpoint_every=1000, logit_chunk=128, eval_batch_size=2)
    reference = distill.DenseReference.compute(teacher, train[:2], recipe=recipe)
    layout = lay.contiguous(model_shape(teacher.config), 2, 1)
    stamps: list[float] = []
    losses: list[float] = []

    def on_step(stats: Any, _last: Any) -> None:
        stamps.append(time.perf_counter())
        losses.append(stats.loss)

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        distill.distill_run(teacher=teacher, layout=layout, seed=0, recipe=recipe, train_blocks=train,
                            reference=reference, run_dir=Path(tmp) / "run", on_step=on_step, world_size=world_size)
        total = time.perf_counter() - t0
    steps = [b - a for a, b in itertools.pairwise(stamps)][1:]  # the first gap warms up
    return {"world_size": world_size, "step_s": statistics.median(steps), "total_s": total, "losses": losses}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-sizes", default="2", help="comma-separated W to compare with W = 1")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--batch", type=int, default=4, help="global batch (a multiple of every W)")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    args = ap.parse_args()
    base = timed_run(1, args)
    rows = [base]
    for w in (int(x) for x in args.world_sizes.split(",")):
        row = timed_run(w, args)
        row["ratio_vs_w1"] = row["step_s"] / base["step_s"]
        row["max_loss_diff_vs_w1"] = max(abs(a - b) for a, b in zip(row["losses"], base["losses"], strict=True))
        rows.append(row)
    for row in rows:
        row.pop("losses")
    print(json.dumps({"cores": torch.get_num_threads(), "args": vars(args), "runs": rows}, indent=1))


if __name__ == "__main__":
    main()

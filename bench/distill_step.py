"""One DTP distillation step over one dense training step on the same tokens.

Qwen3-0.6B-shaped random model (4 layers), fp32 CPU, L=4, δ=1. Target: ratio ≤ 1.3.

- dense step: the standard Hugging Face causal-LM training step, `model(ids, labels=ids).loss`,
  backward, gradient clipping and AdamW over every parameter;
- DTP step (`models.distill.train_step`, the paper's recipe): teacher forward without gradients,
  student forward + backward through the chunked KL + 0.1·CE, clipping and AdamW over the
  student's trainable parameters (embeddings and the tied LM head frozen).

Also printed: the dense step with the embeddings frozen too (the same trainable set as the
student), and the teacher's forward alone, the work the dense step does not have.

    .venv/bin/python bench/distill_step.py [--layers 4 --batch 1 --seq 512 --devices 4 --delta 1 --repeats 3]
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import add_shape_args, interleaved_times, qwen3_06b_shaped
from models import distill
from models.families import model_shape
from models.layouts import layout as lay


def dense_trainer(model: Any, *, freeze_embeddings: bool) -> tuple[Any, Any]:
    """A trainable copy of the dense model and a closure running one standard training step on ids."""
    student = copy.deepcopy(model).train()
    student.model.embed_tokens.weight.requires_grad_(not freeze_embeddings)
    params = [p for p in student.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=5e-5, betas=(0.9, 0.95), weight_decay=0.0)

    def step(ids: torch.Tensor) -> float:
        loss = student(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    return student, step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_args(ap, repeats=3)
    args = ap.parse_args()

    teacher = qwen3_06b_shaped(args.layers)
    recipe = distill.DistillRecipe(batch_size=args.batch, micro_batch_size=args.batch, warmup_steps=0)
    layout = lay.random(model_shape(teacher.config), args.devices, args.delta, seed=1000)
    student = distill.make_student(teacher, layout, recipe)
    optimizer = distill.make_optimizer(student, recipe)
    _, dense_step = dense_trainer(teacher, freeze_embeddings=False)
    _, dense_frozen_step = dense_trainer(teacher, freeze_embeddings=True)
    ids = torch.randint(0, teacher.config.vocab_size, (args.batch, args.seq))

    def teacher_forward() -> None:
        with torch.no_grad():
            hidden = teacher.model(ids).last_hidden_state.reshape(-1, teacher.config.hidden_size)  # [T, D]
            for start in range(0, hidden.shape[0], recipe.logit_chunk):
                torch.log_softmax(teacher.lm_head(hidden[start : start + recipe.logit_chunk]).float(), dim=-1)

    t = interleaved_times({
        "dense": lambda: dense_step(ids),
        "dense_frozen": lambda: dense_frozen_step(ids),
        "dtp": lambda: distill.train_step(student, teacher, ids, optimizer, step=0, recipe=recipe),
        "teacher": teacher_forward,
    }, repeats=args.repeats)
    ratio = t["dtp"] / t["dense"]
    print(f"Qwen3-0.6B-shaped, {args.layers} layers, fp32 CPU ({torch.get_num_threads()} threads), "
          f"L={args.devices}, δ={args.delta}, {args.batch}×{args.seq} tokens, median of {args.repeats}")
    print(f"dense training step (HF loss, all params)   {t['dense'] * 1e3:9.1f} ms")
    print(f"dense step, embeddings frozen                {t['dense_frozen'] * 1e3:9.1f} ms")
    print(f"teacher forward (no grad, chunked logits)    {t['teacher'] * 1e3:9.1f} ms")
    print(f"DTP distillation step                        {t['dtp'] * 1e3:9.1f} ms")
    print(f"ratio DTP / dense step                       {ratio:9.3f}   (target ≤ 1.3)")
    print(f"ratio DTP / dense step (embeddings frozen)   {t['dtp'] / t['dense_frozen']:9.3f}")
    print(f"ratio DTP / (dense step + teacher forward)   {t['dtp'] / (t['dense'] + t['teacher']):9.3f}")
    print(f"ratio DTP / (frozen step + teacher forward)  {t['dtp'] / (t['dense_frozen'] + t['teacher']):9.3f}")


if __name__ == "__main__":
    main()

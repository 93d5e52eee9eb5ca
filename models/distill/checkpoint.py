"""Checkpoints of a run: trainable weights, optimizer state, step, RNG state and the records so far.

Written atomically (a reader never sees half a checkpoint) and read with `weights_only=True`: a
checkpoint is data, never code, since the service may resume a redelivered job. A checkpoint is
resumed only under the fingerprint it was made with.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from models.atomic import atomic_write
from models.distill.recipe import DistillError, DistillRecipe
from models.distill.records import EvalRecord, RunState
from models.distill.student import trainable_parameters
from models.distill.train import StepStats
from models.dtp import DTPModel
from models.layouts.layout import Layout

CHECKPOINT_FORMAT = "dtp-layout-distill-checkpoint/1"


def tensor_fingerprint(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().numpy().tobytes()).hexdigest()[:16]


def run_fingerprint(*, layout: Layout, seed: int, recipe: DistillRecipe, train_blocks: torch.Tensor,
                    eval_blocks: torch.Tensor, model_id: str = "", schedule: str | None = None) -> str:
    """What a run's curve depends on; a checkpoint made under another fingerprint is not resumed."""
    lay = layout.to_json_dict()
    lay.pop("score", None)
    lay.pop("name", None)
    payload = {"layout": lay, "seed": seed, "recipe": recipe.as_dict(), "model": model_id,
               "train": [list(train_blocks.shape), tensor_fingerprint(train_blocks)],
               "eval": [list(eval_blocks.shape), tensor_fingerprint(eval_blocks)]}
    if schedule is not None:  # absent for the layout's dtp:δ, so that earlier runs keep their fingerprints
        payload["schedule"] = schedule
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def save_checkpoint(path: Path, payload: dict[str, Any]) -> None:
    atomic_write(path, lambda tmp: torch.save(payload, tmp))


def load_checkpoint(path: Path) -> dict[str, Any]:
    try:
        data: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise DistillError(f"{path}: cannot read distillation checkpoint: {exc}") from exc
    if data.get("format") != CHECKPOINT_FORMAT:
        raise DistillError(f"{path}: format must be {CHECKPOINT_FORMAT!r}, got {data.get('format')!r}")
    return data


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def checkpoint_payload(student: DTPModel, optimizer: torch.optim.Optimizer, state: RunState, fingerprint: str,
                       seed: int, recipe: DistillRecipe) -> dict[str, Any]:
    return {
        "format": CHECKPOINT_FORMAT,
        "fingerprint": fingerprint,
        "step": state.step,
        "trainable": {name: p.detach().cpu() for name, p in trainable_parameters(student)},
        "optimizer": optimizer.state_dict(),
        "schedule": {"step": state.step},  # the lr is a pure function of the step (learning_rate)
        "data": {"seed": seed, "next_sequence": state.step * recipe.batch_size},
        "rng": _rng_state(),
        "records": [r.as_dict() for r in state.records],
        "steps": [s.as_dict() for s in state.steps],
        "elapsed": state.elapsed,
    }


def restore(data: dict[str, Any], student: DTPModel, optimizer: torch.optim.Optimizer) -> RunState:
    """Load a checkpoint's weights, optimizer and RNG state into the run; its RunState."""
    params = dict(trainable_parameters(student))
    missing = set(params) ^ set(data["trainable"])
    if missing:
        raise DistillError(f"checkpoint does not match the student's trainable parameters: {sorted(missing)[:3]}")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(data["trainable"][name])
    optimizer.load_state_dict(data["optimizer"])
    _set_rng_state(data["rng"])
    return RunState(step=int(data["step"]), records=[EvalRecord(**r) for r in data["records"]],
                    steps=[StepStats(**s) for s in data["steps"]], elapsed=float(data["elapsed"]))

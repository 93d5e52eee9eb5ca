"""Checkpoints of a run: trainable weights, optimizer state, step, RNG state and the records so far.

A checkpoint is a torch.distributed.checkpoint (DCP) directory, `checkpoint/`: the trainable weights
and the AdamW state (`get_state_dict`, frozen parameters left out: they are the teacher's, permuted)
as `.distcp` shards plus DCP's `.metadata`, and `run_state.json` (format, fingerprint, step, the
records and step statistics so far, elapsed time, RNG state). DCP records every tensor's global shape,
so a checkpoint saved by W ranks is loaded by any W (resharding: `set_state_dict`), and by one
process with no process group. It is data, never code (no pickles): the service may resume a
redelivered job. Written to `checkpoint.partial/` and renamed over the old one once complete (a
crash between the two renames leaves `checkpoint.old/`, which is then read). A checkpoint is resumed
only under the fingerprint it was made with.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from models.distill.recipe import DistillError, DistillRecipe
from models.distill.records import EvalRecord, RunState
from models.distill.sharding import Ranks
from models.distill.train import StepStats
from models.io.atomic import atomic_write_json
from models.layouts.layout import Layout
from models.schedules.grammar import ScheduleSpec, shorthand
from models.sim.dtp import DTPModel

CHECKPOINT_FORMAT = "dtp-layout-distill-checkpoint/2"
CHECKPOINT_DIR = "checkpoint"
RUN_STATE = "run_state.json"


def tensor_fingerprint(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().numpy().tobytes()).hexdigest()[:16]


def run_fingerprint(*, layout: Layout, seed: int, recipe: DistillRecipe, train_blocks: torch.Tensor,
                    eval_blocks: torch.Tensor, model_id: str = "", schedule: ScheduleSpec | None = None) -> str:
    """What a run's curve depends on; a checkpoint made under another fingerprint is not resumed."""
    lay = layout.to_json_dict()
    lay.pop("score", None)
    lay.pop("name", None)
    payload = {"layout": lay, "seed": seed, "recipe": recipe.as_dict(), "model": model_id,
               "train": [list(train_blocks.shape), tensor_fingerprint(train_blocks)],
               "eval": [list(eval_blocks.shape), tensor_fingerprint(eval_blocks)]}
    stored = shorthand(schedule, layout.delta)
    if stored is not None:  # absent for the layout's dtp:δ, so that earlier runs keep their fingerprints
        payload["schedule"] = stored
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def _options() -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # Frozen parameters are the teacher's (permuted): not saved, so not expected back (strict=False);
    # a trainable one missing from the checkpoint still fails in dcp.load.
    return StateDictOptions(ignore_frozen_params=True, strict=False)


def _state_dicts(student: DTPModel, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(student, optimizer, options=_options())
    return {"model": model_sd, "optim": optim_sd}


@contextlib.contextmanager
def _one_process_quietly() -> Iterator[None]:
    """DCP warns that it assumes one process when there is no process group: W = 1 is exactly that."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _rng_state() -> str:
    return base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()


def _set_rng_state(text: str) -> None:
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8))


def _siblings(directory: Path) -> tuple[Path, Path]:
    return directory.with_name(directory.name + ".partial"), directory.with_name(directory.name + ".old")


def checkpoint_to_read(directory: Path) -> Path | None:
    """The complete checkpoint directory of a run, if any (`checkpoint/`, else a left-over `checkpoint.old/`)."""
    _, old = _siblings(directory)
    for candidate in (directory, old):
        if (candidate / RUN_STATE).is_file():
            return candidate
    return None


def save_checkpoint(directory: Path, *, student: DTPModel, optimizer: torch.optim.Optimizer, state: RunState,
                    fingerprint: str, seed: int, recipe: DistillRecipe, ranks: Ranks) -> None:
    """Every rank writes its shards (DCP) to `checkpoint.partial/`; rank 0 then adds run_state.json
    and renames it over `directory`."""
    import torch.distributed.checkpoint as dcp

    partial, old = _siblings(directory)
    if ranks.writer:
        shutil.rmtree(partial, ignore_errors=True)
    ranks.barrier()
    with _one_process_quietly():
        dcp.save(_state_dicts(student, optimizer), checkpoint_id=str(partial), no_dist=not ranks.sharded)
    if ranks.writer:
        atomic_write_json(partial / RUN_STATE, {
            "format": CHECKPOINT_FORMAT, "fingerprint": fingerprint, "step": state.step,
            "world_size": ranks.world_size,
            "schedule": {"step": state.step},  # the lr is a pure function of the step (learning_rate)
            "data": {"seed": seed, "next_sequence": state.step * recipe.batch_size},
            "rng": {"torch": _rng_state()},
            "records": [r.as_dict() for r in state.records], "steps": [s.as_dict() for s in state.steps],
            "elapsed": state.elapsed})
        shutil.rmtree(old, ignore_errors=True)
        if directory.exists():
            directory.rename(old)
        partial.rename(directory)
        shutil.rmtree(old, ignore_errors=True)
    ranks.barrier()


def remove_checkpoint(directory: Path) -> None:
    for path in (directory, *_siblings(directory)):
        shutil.rmtree(path, ignore_errors=True)


def read_run_state(directory: Path) -> dict[str, Any]:
    """run_state.json of a checkpoint directory, checked for its format."""
    path = directory / RUN_STATE
    try:
        data: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise DistillError(f"{path}: cannot read distillation checkpoint: {exc}") from exc
    if not isinstance(data, dict) or data.get("format") != CHECKPOINT_FORMAT:
        got = data.get("format") if isinstance(data, dict) else None
        raise DistillError(f"{path}: format must be {CHECKPOINT_FORMAT!r}, got {got!r}")
    return data


def restore(directory: Path, data: dict[str, Any], student: DTPModel, optimizer: torch.optim.Optimizer) -> RunState:
    """Load a checkpoint's weights and optimizer state (resharded to this run's ranks) and RNG state; its RunState."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = _state_dicts(student, optimizer)
    try:
        with _one_process_quietly():
            dcp.load(state, checkpoint_id=str(directory), no_dist=not torch.distributed.is_initialized())
    except Exception as exc:  # DCP's CheckpointException carries every rank's failure
        raise DistillError(f"{directory}: checkpoint does not match the student: {exc}") from exc
    set_state_dict(student, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=_options())
    _set_rng_state(data["rng"]["torch"])
    return RunState(step=int(data["step"]), records=[EvalRecord(**r) for r in data["records"]],
                    steps=[StepStats(**s) for s in data["steps"]], elapsed=float(data["elapsed"]))

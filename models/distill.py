"""Distilling a DTP model from the dense one, and comparing layouts by how fast they get there (§4–5).

Student: the DTP simulator (L, δ) over the permuted weights of a layout; teacher: the frozen dense
model (a permutation does not change it). The paper's recipe is the default (`DistillRecipe`): loss
per token KL(teacher ‖ student) + 0.1·CE, AdamW β=(0.9, 0.95) without weight decay, lr 5e-5 with
100 linear warm-up steps and cosine decay to 5e-6, gradient clipping at 1, embeddings frozen, fp32
master weights with bf16 autocast on CUDA (plain fp32 on CPU), 16 sequences per step through
micro-batches and gradient accumulation.

The loss over the vocabulary is computed `logit_chunk` tokens at a time from the final hidden
states, and its gradient with respect to the student's hidden state is formed by hand per chunk
(softmax differences), so neither the teacher's nor the student's fp32 logits for the whole batch
ever exist and autograd never stores a [T, V] tensor; the decoder stack is then back-propagated
once from that hidden-state gradient.

Each (layout, seed) run keeps its own directory: `metrics.csv` / `metrics.json` rewritten after
every evaluation, and `checkpoint.pt` (trainable weights, optimizer state, step, RNG state, the
records so far) written atomically every `checkpoint_every` evaluations and at the end. A run
started over an existing directory with the same configuration resumes from that checkpoint; the
training seed only changes the block order, which is a pure function of (seed, step), so a resumed
run follows the uninterrupted curve.
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
import io
import json
import math
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from models import layout as layout_mod
from models.affinity import Cancelled
from models.calibration import CalibrationSpec, load_blocks
from models.dtp import DTPModel, LastScale
from models.export import permuted_copy
from models.families import model_shape
from models.layout import Layout, LayoutError, ModelShape

Progress = Callable[[str, float], None]
ShouldStop = Callable[[], bool]
Autocast = Literal["auto", "bf16", "none"]

RUN_FORMAT = "dtp-layout-distill-run/1"
SUMMARY_FORMAT = "dtp-layout-distill/1"
CHECKPOINT_FORMAT = "dtp-layout-distill-checkpoint/1"
METRIC_COLUMNS = ("layout", "seed", "step", "kl", "ppl", "loss", "lr")
STEP_COLUMNS = ("step", "loss", "kl", "ce", "grad_norm", "lr")
WIKITEXT2_TEST = "hf:Salesforce/wikitext:wikitext-2-raw-v1:test"
STAGE = "distilling"


class DistillError(ValueError):
    """A distillation request that cannot run as given (bad recipe, layouts, or run directory)."""


# ---- configuration -----------------------------------------------------------------------------

@dataclass(frozen=True)
class DistillRecipe:
    """Every number of the training recipe; the defaults are the paper's."""

    steps: int = 1000
    batch_size: int = 16  # sequences per optimiser step
    micro_batch_size: int = 4  # sequences per forward/backward (gradient accumulation)
    lr: float = 5e-5
    min_lr: float = 5e-6
    warmup_steps: int = 100
    betas: tuple[float, float] = (0.9, 0.95)
    adam_eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip: float = 1.0  # max global gradient norm; 0 turns clipping off
    ce_weight: float = 0.1
    freeze_embeddings: bool = True  # a tied LM head is the embedding matrix and is frozen with it
    freeze_lm_head: bool = False  # an untied LM head trains unless this is set
    autocast: Autocast = "auto"  # auto: bf16 on CUDA, fp32 on CPU
    gradient_checkpointing: bool = False
    logit_chunk: int = 256  # tokens per chunk of the loss over the vocabulary
    eval_every: int = 100
    eval_batch_size: int = 4
    checkpoint_every: int = 5  # evaluations between checkpoints (the last step is always checkpointed)
    last_scale: LastScale = "sqrt"

    def __post_init__(self) -> None:
        positive = ("steps", "batch_size", "micro_batch_size", "logit_chunk", "eval_every", "eval_batch_size",
                    "checkpoint_every")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise DistillError(f"recipe.{name} must be a positive integer, got {value!r}")
        if self.batch_size % self.micro_batch_size:
            raise DistillError(f"recipe.batch_size={self.batch_size} must be a multiple of "
                               f"micro_batch_size={self.micro_batch_size}")
        if self.warmup_steps < 0:
            raise DistillError(f"recipe.warmup_steps must be ≥ 0, got {self.warmup_steps}")
        if not 0 < self.min_lr <= self.lr:
            raise DistillError(f"recipe needs 0 < min_lr ≤ lr, got lr={self.lr}, min_lr={self.min_lr}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise DistillError(f"recipe.betas must be two numbers in [0, 1), got {self.betas!r}")
        for name in ("weight_decay", "grad_clip", "ce_weight"):
            if getattr(self, name) < 0:
                raise DistillError(f"recipe.{name} must be ≥ 0, got {getattr(self, name)}")
        if self.autocast not in ("auto", "bf16", "none"):
            raise DistillError(f"recipe.autocast must be auto, bf16 or none, got {self.autocast!r}")
        if self.last_scale not in ("sqrt", "one"):
            raise DistillError(f"recipe.last_scale must be sqrt or one, got {self.last_scale!r}")
        object.__setattr__(self, "betas", tuple(float(b) for b in self.betas))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DistillRecipe:
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise DistillError(f"recipe: unknown field(s) {', '.join(sorted(unknown))}")
        values = dict(data)
        if "betas" in values:
            values["betas"] = tuple(values["betas"])
        return cls(**values)

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["betas"] = list(self.betas)
        return out


@dataclass(frozen=True)
class DistillSpec:
    """A layout comparison: every (layout, seed) pair is one run of the same recipe.

    layouts: names resolved by `resolve_layouts` (optimised and ablations from a layouts directory,
    `contiguous`, `random-<seed>` / `random:<seed>`, or a dtp-layout/1 JSON path).
    """

    layouts: tuple[str, ...]
    train: CalibrationSpec
    eval: CalibrationSpec
    devices: int
    delta: int = 1
    seeds: tuple[int, ...] = (0,)
    recipe: DistillRecipe = field(default_factory=DistillRecipe)
    reference: str = "contiguous"  # the headline compares `candidate` against `reference`
    candidate: str = "optimised"

    def __post_init__(self) -> None:
        object.__setattr__(self, "layouts", tuple(self.layouts))
        object.__setattr__(self, "seeds", tuple(int(s) for s in self.seeds))
        if not self.layouts:
            raise DistillError("layouts: give at least one layout")
        if len(set(self.layouts)) != len(self.layouts):
            raise DistillError(f"layouts: duplicates in {', '.join(self.layouts)}")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise DistillError(f"seeds: give distinct integers, got {list(self.seeds)}")


# ---- schedule and data order -------------------------------------------------------------------

def learning_rate(step: int, recipe: DistillRecipe) -> float:
    """The lr of optimiser step `step` (0-based): linear warm-up, then cosine decay to min_lr.

    warm-up (step < W):  lr · (step + 1) / W
    decay:               min_lr + (lr − min_lr) · ½ · (1 + cos(π · (step − W) / (steps − W)))
    """
    warmup = recipe.warmup_steps
    if step < warmup:
        return recipe.lr * (step + 1) / warmup
    span = max(1, recipe.steps - warmup)
    progress = min(1.0, (step - warmup) / span)
    return recipe.min_lr + (recipe.lr - recipe.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


@lru_cache(maxsize=8)
def _epoch_order(seed: int, epoch: int, n: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n)


def batch_indices(step: int, *, batch_size: int, num_blocks: int, seed: int) -> np.ndarray:
    """Block indices of optimiser step `step`: consecutive slices of seeded per-epoch permutations.

    A pure function of (seed, step), so a resumed run reads exactly the blocks it would have read.
    """
    flat = np.arange(step * batch_size, (step + 1) * batch_size)
    epochs, positions = np.divmod(flat, num_blocks)
    return np.array([_epoch_order(seed, int(e), num_blocks)[p] for e, p in zip(epochs, positions, strict=True)])


# ---- student and teacher -----------------------------------------------------------------------

def make_student(teacher: nn.Module, layout: Layout, recipe: DistillRecipe) -> DTPModel:
    """A DTP model over an fp32 deep copy of the teacher permuted by `layout` (no shared parameters)."""
    permuted = permuted_copy(teacher, layout)
    inner: Any = permuted
    for p in permuted.parameters():
        # fp32 master weights. Not `.float()`: transformers refuses it on models loaded from GGUF.
        if p.dtype != torch.float32:
            p.data = p.data.float()
        p.requires_grad_(True)
    if recipe.freeze_embeddings:
        inner.model.embed_tokens.weight.requires_grad_(False)  # tied LM head: the same Parameter
    if recipe.freeze_lm_head:
        for p in inner.lm_head.parameters():
            p.requires_grad_(False)
    return DTPModel(permuted, devices=layout.devices, delta=layout.delta, last_scale=recipe.last_scale,
                    gradient_checkpointing=recipe.gradient_checkpointing)


def trainable_parameters(student: DTPModel) -> list[tuple[str, nn.Parameter]]:
    return [(name, p) for name, p in student.named_parameters() if p.requires_grad]


def _autocast(recipe: DistillRecipe, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    use_bf16 = recipe.autocast == "bf16" or (recipe.autocast == "auto" and device.type == "cuda")
    if not use_bf16:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def _lm_head(model: Any) -> nn.Linear:
    head = model.lm_head
    assert isinstance(head, nn.Linear)
    return head


def next_token_targets(ids: torch.Tensor) -> torch.Tensor:
    """ids: [B, S] -> targets [B*S]: the next token, -100 on each sequence's last position."""
    return torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1).reshape(-1)


# ---- the loss, chunked over tokens -------------------------------------------------------------

@dataclass
class LossSums:
    """Sums over tokens (not means): KL(teacher ‖ student), student CE, and their token counts."""

    kl: float = 0.0
    ce: float = 0.0
    kl_tokens: int = 0
    ce_tokens: int = 0

    def add(self, other: LossSums) -> None:
        self.kl += other.kl
        self.ce += other.ce
        self.kl_tokens += other.kl_tokens
        self.ce_tokens += other.ce_tokens


def _chunk_loss_grad(student_logits: torch.Tensor, teacher_logits: torch.Tensor, targets: torch.Tensor, *,
                     kl_scale: float, ce_scale: float) -> tuple[float, float, torch.Tensor]:
    """(KL sum, CE sum, d loss / d student logits) for one chunk, loss = kl_scale·KL + ce_scale·CE.

    *_logits: [t, V]; targets: [t] with -100 where there is no next token. With q = softmax(student)
    and p = softmax(teacher): dKL/ds = q − p and dCE/ds = q − onehot(target), per token.
    """
    logq = F.log_softmax(student_logits.float(), dim=-1)  # [t, V]
    logp = F.log_softmax(teacher_logits.float(), dim=-1)  # [t, V]
    p = logp.exp()  # [t, V]
    # Σ p·(log p − log q) as two dot products: no third [t, V] buffer.
    kl = torch.dot(p.view(-1), logp.view(-1)) - torch.dot(p.view(-1), logq.view(-1))
    has_target = targets != -100  # [t]
    rows = has_target.nonzero().squeeze(1)
    tgt = targets[rows]
    ce = -logq[rows, tgt].sum()
    grad = logq.exp_()  # q, in place: logq is not needed any more
    row_scale = kl_scale + ce_scale * has_target.to(grad.dtype)  # [t]
    grad.mul_(row_scale[:, None]).sub_(p, alpha=kl_scale)
    grad[rows, tgt] -= ce_scale
    return float(kl), float(ce), grad


def loss_and_backward(student: DTPModel, teacher: nn.Module, ids: torch.Tensor, *, recipe: DistillRecipe,
                      kl_norm: int, ce_norm: int) -> LossSums:
    """Forward both models on ids [b, S], accumulate d(loss)/d(params) into the student's .grad.

    loss = Σ KL / kl_norm + ce_weight · Σ CE / ce_norm, so that micro-batches with the step's total
    token counts as norms add up to the step's per-token mean.
    """
    device = ids.device
    b, s = ids.shape
    teacher_any: Any = teacher
    with torch.no_grad(), _autocast(recipe, device):
        hidden_t = teacher_any.model(ids).last_hidden_state.reshape(b * s, -1)  # [T, D]
    with _autocast(recipe, device):
        hidden_s = student.hidden_states(ids)  # [b, S, D]
    flat_s = hidden_s.detach().reshape(b * s, -1)  # [T, D]
    targets = next_token_targets(ids)  # [T]
    head_s, head_t = _lm_head(student.model), _lm_head(teacher)
    train_head = head_s.weight.requires_grad
    grad_hidden = torch.empty_like(flat_s, dtype=torch.float32)  # [T, D]
    grad_head = torch.zeros_like(head_s.weight, dtype=torch.float32) if train_head else None  # [V, D]
    sums = LossSums(kl_tokens=b * s, ce_tokens=int((targets != -100).sum()))
    for start in range(0, b * s, recipe.logit_chunk):
        sl = slice(start, start + recipe.logit_chunk)
        with torch.no_grad(), _autocast(recipe, device):
            logits_s, logits_t = head_s(flat_s[sl]), head_t(hidden_t[sl])  # [t, V]
        kl, ce, grad_logits = _chunk_loss_grad(logits_s, logits_t, targets[sl], kl_scale=1.0 / kl_norm,
                                               ce_scale=recipe.ce_weight / ce_norm)
        del logits_s, logits_t
        sums.kl += kl
        sums.ce += ce
        with torch.no_grad(), _autocast(recipe, device):
            grad_hidden[sl] = grad_logits.to(head_s.weight.dtype) @ head_s.weight  # [t, D]
            if grad_head is not None:
                grad_head += grad_logits.t().to(flat_s.dtype) @ flat_s[sl]  # [V, D]
    hidden_s.backward(grad_hidden.view(b, s, -1).to(hidden_s.dtype))
    if grad_head is not None:
        head_s.weight.grad = grad_head if head_s.weight.grad is None else head_s.weight.grad + grad_head
    return sums


# ---- one optimiser step ------------------------------------------------------------------------

@dataclass(frozen=True)
class StepStats:
    step: int  # 0-based index of the optimiser step that produced these numbers
    loss: float  # KL + ce_weight · CE, per-token means over the step's batch
    kl: float
    ce: float
    grad_norm: float  # before clipping
    lr: float

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


def make_optimizer(student: DTPModel, recipe: DistillRecipe) -> torch.optim.AdamW:
    params = [p for _, p in trainable_parameters(student)]
    return torch.optim.AdamW(params, lr=recipe.lr, betas=recipe.betas, eps=recipe.adam_eps,
                             weight_decay=recipe.weight_decay)


def train_step(student: DTPModel, teacher: nn.Module, batch: torch.Tensor, optimizer: torch.optim.Optimizer, *,
               step: int, recipe: DistillRecipe) -> StepStats:
    """One optimiser step on batch [batch_size, S] through micro-batches and gradient accumulation."""
    student.train()
    lr = learning_rate(step, recipe)
    for group in optimizer.param_groups:
        group["lr"] = lr
    b, s = batch.shape
    kl_norm, ce_norm = b * s, b * (s - 1)
    sums = LossSums()
    for start in range(0, b, recipe.micro_batch_size):
        micro = batch[start : start + recipe.micro_batch_size]
        sums.add(loss_and_backward(student, teacher, micro, recipe=recipe, kl_norm=kl_norm, ce_norm=ce_norm))
    params = [p for group in optimizer.param_groups for p in group["params"]]
    max_norm = recipe.grad_clip if recipe.grad_clip > 0 else math.inf
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    kl, ce = sums.kl / kl_norm, sums.ce / ce_norm
    return StepStats(step=step, loss=kl + recipe.ce_weight * ce, kl=kl, ce=ce, grad_norm=grad_norm, lr=lr)


# ---- evaluation --------------------------------------------------------------------------------

@dataclass
class DenseReference:
    """The teacher's final hidden states on the evaluation blocks, computed once for every run."""

    blocks: torch.Tensor  # [n, S] token ids
    hidden: torch.Tensor  # [n, S, D], the teacher's dtype
    dense_ppl: float

    @classmethod
    def compute(cls, teacher: nn.Module, blocks: torch.Tensor, *, recipe: DistillRecipe) -> DenseReference:
        device = next(teacher.parameters()).device
        teacher_any: Any = teacher
        head = _lm_head(teacher)
        hidden, nll = [], 0.0
        with torch.no_grad(), _autocast(recipe, device):
            for start in range(0, blocks.shape[0], recipe.eval_batch_size):
                ids = blocks[start : start + recipe.eval_batch_size].to(device)  # [b, S]
                h = teacher_any.model(ids).last_hidden_state  # [b, S, D]
                hidden.append(h)
                flat, targets = h.reshape(-1, h.shape[-1]), next_token_targets(ids)
                for c in range(0, flat.shape[0], recipe.logit_chunk):
                    logp = F.log_softmax(head(flat[c : c + recipe.logit_chunk]).float(), dim=-1)  # [t, V]
                    nll += F.nll_loss(logp, targets[c : c + recipe.logit_chunk], ignore_index=-100,
                                      reduction="sum").item()
        n, s = blocks.shape
        return cls(blocks=blocks.to(device), hidden=torch.cat(hidden), dense_ppl=math.exp(nll / (n * (s - 1))))


@torch.no_grad()
def evaluate_student(student: DTPModel, teacher: nn.Module, reference: DenseReference, *,
                     recipe: DistillRecipe) -> tuple[float, float]:
    """(mean per-token KL(dense ‖ DTP) in nats over all tokens, DTP perplexity) on the reference blocks."""
    was_training = student.training
    student.eval()
    device = reference.blocks.device
    head_s, head_t = _lm_head(student.model), _lm_head(teacher)
    kl = nll = 0.0
    n, s = reference.blocks.shape
    with _autocast(recipe, device):
        for start in range(0, n, recipe.eval_batch_size):
            ids = reference.blocks[start : start + recipe.eval_batch_size]  # [b, S]
            flat_s = student.hidden_states(ids).reshape(-1, reference.hidden.shape[-1])  # [T, D]
            flat_t = reference.hidden[start : start + recipe.eval_batch_size].reshape(flat_s.shape)
            targets = next_token_targets(ids)
            for c in range(0, flat_s.shape[0], recipe.logit_chunk):
                sl = slice(c, c + recipe.logit_chunk)
                logq = F.log_softmax(head_s(flat_s[sl]).float(), dim=-1)  # [t, V]
                logp = F.log_softmax(head_t(flat_t[sl]).float(), dim=-1)
                kl += F.kl_div(logq, logp, log_target=True, reduction="sum").item()
                nll += F.nll_loss(logq, targets[sl], ignore_index=-100, reduction="sum").item()
    student.train(was_training)
    return kl / (n * s), math.exp(nll / (n * (s - 1)))


# ---- records, logs and checkpoints -------------------------------------------------------------

@dataclass(frozen=True)
class EvalRecord:
    """One evaluation of one run: what `metrics.csv` holds per row (plus timing)."""

    layout: str
    seed: int
    step: int  # optimiser steps taken before this evaluation
    kl: float
    ppl: float
    loss: float | None  # mean training loss over the steps since the previous evaluation
    lr: float  # lr of the last step taken (of step 0 at step 0)
    tokens: int  # training tokens seen
    elapsed_s: float  # wall seconds of this run so far (across resumes)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _atomic_write_text(path: Path, text: str) -> None:
    _atomic_write_bytes(path, text.encode("utf-8"))


def _csv_text(columns: Sequence[str], rows: Sequence[dict[str, Any]]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(columns), extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: ("" if row.get(k) is None else row[k]) for k in columns})
    return buf.getvalue()


def _json_safe(value: Any) -> Any:
    """NaN/inf are not JSON: write them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


def _save_checkpoint(path: Path, payload: dict[str, Any]) -> None:
    """torch.save to a temporary sibling, then rename: a reader never sees half a checkpoint."""
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        torch.save(payload, tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _load_checkpoint(path: Path) -> dict[str, Any]:
    try:
        # weights_only: a checkpoint is data, never code (the service may resume a redelivered job).
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


def tensor_fingerprint(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().numpy().tobytes()).hexdigest()[:16]


def run_fingerprint(*, layout: Layout, seed: int, recipe: DistillRecipe, train_blocks: torch.Tensor,
                    eval_blocks: torch.Tensor, model_id: str = "") -> str:
    """What a run's curve depends on; a checkpoint made under another fingerprint is not resumed."""
    lay = layout.to_json_dict()
    lay.pop("score", None)
    lay.pop("name", None)
    payload = {"layout": lay, "seed": seed, "recipe": recipe.as_dict(), "model": model_id,
               "train": [list(train_blocks.shape), tensor_fingerprint(train_blocks)],
               "eval": [list(eval_blocks.shape), tensor_fingerprint(eval_blocks)]}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


# ---- one run -----------------------------------------------------------------------------------

@dataclass
class RunResult:
    layout: str
    seed: int
    records: list[EvalRecord]
    steps: list[StepStats]
    run_dir: Path
    resumed_from: int | None  # the checkpoint step this call started from, if any
    seconds: float

    @property
    def final(self) -> EvalRecord:
        return self.records[-1]


@dataclass
class _RunState:
    step: int = 0
    records: list[EvalRecord] = field(default_factory=list)
    steps: list[StepStats] = field(default_factory=list)
    elapsed: float = 0.0


def eval_steps(recipe: DistillRecipe) -> list[int]:
    """The steps after which a run evaluates: 0, every eval_every, and the last."""
    steps = list(range(0, recipe.steps + 1, recipe.eval_every))
    return steps if steps[-1] == recipe.steps else [*steps, recipe.steps]


def _write_logs(run_dir: Path, *, layout: Layout, seed: int, fingerprint: str, recipe: DistillRecipe,
                state: _RunState, complete: bool, dense_ppl: float) -> None:
    rows = [r.as_dict() for r in state.records]
    _atomic_write_text(run_dir / "metrics.csv", _csv_text(METRIC_COLUMNS, rows))
    _atomic_write_text(run_dir / "steps.csv", _csv_text(STEP_COLUMNS, [s.as_dict() for s in state.steps]))
    doc = {"format": RUN_FORMAT, "layout": layout.name, "seed": seed, "fingerprint": fingerprint,
           "devices": layout.devices, "delta": layout.delta, "recipe": recipe.as_dict(), "dense_ppl": dense_ppl,
           "complete": complete, "records": rows}
    _atomic_write_text(run_dir / "metrics.json", json.dumps(_json_safe(doc), indent=1))


def _read_complete(run_dir: Path, fingerprint: str) -> list[EvalRecord] | None:
    """The records of a finished run with this fingerprint, else None; refuses another run's directory."""
    try:
        doc = json.loads((run_dir / "metrics.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if doc.get("fingerprint") != fingerprint:
        raise DistillError(f"{run_dir} holds a run of a different configuration (layout, seed, recipe or data); "
                           "use another output directory or remove it (--overwrite)")
    if not doc.get("complete"):
        return None
    return [EvalRecord(**{**r, "loss": r.get("loss")}) for r in doc["records"]]


def _checkpoint_payload(student: DTPModel, optimizer: torch.optim.Optimizer, state: _RunState,
                        fingerprint: str, seed: int, recipe: DistillRecipe) -> dict[str, Any]:
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


def _restore(data: dict[str, Any], student: DTPModel, optimizer: torch.optim.Optimizer) -> _RunState:
    params = dict(trainable_parameters(student))
    missing = set(params) ^ set(data["trainable"])
    if missing:
        raise DistillError(f"checkpoint does not match the student's trainable parameters: {sorted(missing)[:3]}")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(data["trainable"][name])
    optimizer.load_state_dict(data["optimizer"])
    _set_rng_state(data["rng"])
    return _RunState(step=int(data["step"]), records=[EvalRecord(**r) for r in data["records"]],
                     steps=[StepStats(**s) for s in data["steps"]], elapsed=float(data["elapsed"]))


def _mean_loss_since(state: _RunState, previous_eval: int) -> float | None:
    losses = [s.loss for s in state.steps if s.step >= previous_eval]
    return sum(losses) / len(losses) if losses else None


@dataclass(frozen=True)
class RunHooks:
    """A run's callbacks (all optional); see `distill_run`."""

    progress: Progress | None = None
    should_stop: ShouldStop | None = None
    on_eval: Callable[[EvalRecord], None] | None = None
    on_step: Callable[[StepStats, EvalRecord | None], None] | None = None
    on_restore: Callable[[list[EvalRecord]], None] | None = None


class _Run:
    """One (layout, seed) run over its directory: the training loop, its evaluations and checkpoints."""

    def __init__(self, *, teacher: nn.Module, layout: Layout, seed: int, recipe: DistillRecipe,
                 train_blocks: torch.Tensor, reference: DenseReference, run_dir: Path, fingerprint: str,
                 hooks: RunHooks, keep_checkpoint: bool) -> None:
        self.teacher, self.layout, self.seed, self.recipe = teacher, layout, seed, recipe
        self.train_blocks, self.reference, self.run_dir = train_blocks, reference, run_dir
        self.fingerprint, self.hooks, self.keep_checkpoint = fingerprint, hooks, keep_checkpoint
        self.device = next(teacher.parameters()).device
        self.student = make_student(teacher, layout, recipe).to(self.device)
        self.optimizer = make_optimizer(self.student, recipe)
        self.ckpt_path = run_dir / "checkpoint.pt"
        self.state = _RunState()
        self.evals = eval_steps(recipe)
        self.clock_start = time.perf_counter()

    def restore(self) -> int | None:
        """Load the checkpoint if there is one; the step it was taken at."""
        if not self.ckpt_path.exists():
            return None
        data = _load_checkpoint(self.ckpt_path)
        if data["fingerprint"] != self.fingerprint:
            raise DistillError(f"{self.ckpt_path} was made by a different configuration (layout, seed, recipe or "
                               "data); use another output directory or remove it (--overwrite)")
        self.state = _restore(data, self.student, self.optimizer)
        self.clock_start = time.perf_counter() - self.state.elapsed  # elapsed_s counts across resumes
        if self.hooks.on_restore:
            self.hooks.on_restore(list(self.state.records))
        return self.state.step

    def due_for_eval(self) -> bool:
        state = self.state
        return state.step in self.evals and (not state.records or state.records[-1].step < state.step)

    def evaluate(self) -> EvalRecord:
        state, recipe = self.state, self.recipe
        kl, ppl = evaluate_student(self.student, self.teacher, self.reference, recipe=recipe)
        previous = max((e for e in self.evals if e < state.step), default=0)
        state.elapsed = time.perf_counter() - self.clock_start
        return EvalRecord(layout=self.layout.name, seed=self.seed, step=state.step, kl=kl, ppl=ppl,
                          loss=_mean_loss_since(state, previous),
                          lr=state.steps[-1].lr if state.steps else learning_rate(0, recipe),
                          tokens=state.step * recipe.batch_size * self.train_blocks.shape[1],
                          elapsed_s=state.elapsed)

    def write_logs(self, complete: bool) -> None:
        _write_logs(self.run_dir, layout=self.layout, seed=self.seed, fingerprint=self.fingerprint,
                    recipe=self.recipe, state=self.state, complete=complete, dense_ppl=self.reference.dense_ppl)

    def save(self, complete: bool) -> None:
        if not complete or self.keep_checkpoint:
            _save_checkpoint(self.ckpt_path, _checkpoint_payload(self.student, self.optimizer, self.state,
                                                                 self.fingerprint, self.seed, self.recipe))
        self.write_logs(complete)
        if complete and not self.keep_checkpoint:
            self.ckpt_path.unlink(missing_ok=True)  # only once the logs say the run is complete

    def eval_and_log(self) -> None:
        record = self.evaluate()
        self.state.records.append(record)
        finished = self.state.step == self.recipe.steps
        if finished or len(self.state.records) % self.recipe.checkpoint_every == 0:
            self.save(complete=finished)
        else:
            self.write_logs(complete=False)
        if self.hooks.on_eval:
            self.hooks.on_eval(record)

    def train_one_step(self) -> None:
        state, recipe = self.state, self.recipe
        if self.hooks.should_stop is not None and self.hooks.should_stop():
            raise Cancelled(f"distillation of {self.layout.name} (seed {self.seed}) cancelled at step {state.step}")
        index = batch_indices(state.step, batch_size=recipe.batch_size, num_blocks=len(self.train_blocks),
                              seed=self.seed)
        batch = self.train_blocks[torch.from_numpy(index)].to(self.device)  # [batch_size, S]
        stats = train_step(self.student, self.teacher, batch, self.optimizer, step=state.step, recipe=recipe)
        if not math.isfinite(stats.loss):
            raise DistillError(f"{self.layout.name} (seed {self.seed}): loss is {stats.loss} at step {state.step}; "
                               "lower the learning rate or check the data")
        state.steps.append(stats)
        state.step += 1
        if self.hooks.on_step:
            self.hooks.on_step(stats, state.records[-1] if state.records else None)
        if self.hooks.progress:
            self.hooks.progress(STAGE, state.step / recipe.steps)

    def run(self) -> None:
        while True:
            if self.due_for_eval():
                self.eval_and_log()
            if self.state.step >= self.recipe.steps:
                return
            self.train_one_step()


def distill_run(*, teacher: nn.Module, layout: Layout, seed: int, recipe: DistillRecipe,
                train_blocks: torch.Tensor, reference: DenseReference, run_dir: Path, model_id: str = "",
                progress: Progress | None = None, should_stop: ShouldStop | None = None,
                on_eval: Callable[[EvalRecord], None] | None = None,
                on_step: Callable[[StepStats, EvalRecord | None], None] | None = None,
                on_restore: Callable[[list[EvalRecord]], None] | None = None,
                keep_checkpoint: bool = True) -> RunResult:
    """Distil the DTP model of `layout` from `teacher`, evaluating on `reference`; resume if possible.

    train_blocks: [n, S] token ids; each step reads batch_size of them (see `batch_indices`).
    Raises `Cancelled` between steps when should_stop() is true (the last checkpoint stays).
    on_restore gets the evaluations read back from a finished run or a checkpoint; evaluations past
    the checkpoint are recomputed and passed to on_eval again (same layout, seed and step).
    """
    t_start = time.perf_counter()
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    fingerprint = run_fingerprint(layout=layout, seed=seed, recipe=recipe, train_blocks=train_blocks,
                                  eval_blocks=reference.blocks, model_id=model_id)
    done = _read_complete(run_dir, fingerprint)
    if done is not None:
        if on_restore:
            on_restore(done)
        if progress:
            progress(STAGE, 1.0)
        return RunResult(layout.name, seed, done, [], run_dir, recipe.steps, 0.0)
    if len(train_blocks) < recipe.batch_size:
        raise DistillError(f"{len(train_blocks)} training blocks, fewer than batch_size={recipe.batch_size}")
    hooks = RunHooks(progress=progress, should_stop=should_stop, on_eval=on_eval, on_step=on_step,
                     on_restore=on_restore)
    run = _Run(teacher=teacher, layout=layout, seed=seed, recipe=recipe, train_blocks=train_blocks,
               reference=reference, run_dir=run_dir, fingerprint=fingerprint, hooks=hooks,
               keep_checkpoint=keep_checkpoint)
    resumed_from = run.restore()
    run.run()
    return RunResult(layout.name, seed, run.state.records, run.state.steps, run_dir, resumed_from,
                     time.perf_counter() - t_start)


# ---- comparing layouts -------------------------------------------------------------------------

def reach_step(steps: Sequence[float], kls: Sequence[float], target: float) -> float | None:
    """First step at which the piecewise-linear curve (steps, kls) reaches KL ≤ target, else None."""
    for i, (s, k) in enumerate(zip(steps, kls, strict=True)):
        if k <= target:
            if i == 0:
                return float(s)
            s0, k0 = steps[i - 1], kls[i - 1]
            return float(s0 + (k0 - target) / (k0 - k) * (s - s0))
    return None


def multipliers(reference: tuple[Sequence[int], Sequence[float]],
                candidate: tuple[Sequence[int], Sequence[float]]) -> list[dict[str, float | None]]:
    """Per reference evaluation s > 0 with KL k: the candidate's interpolated step reaching k, and s over it."""
    ref_steps, ref_kls = reference
    rows: list[dict[str, float | None]] = []
    for s, k in zip(ref_steps, ref_kls, strict=True):
        if s == 0:
            continue
        reached = reach_step(candidate[0], candidate[1], k)
        mult = s / reached if reached else None  # reached at step 0 (or never): no finite multiplier
        rows.append({"step": s, "reference_kl": k, "candidate_step": reached, "multiplier": mult})
    return rows


def _mean_curves(records: Sequence[EvalRecord]) -> dict[str, dict[str, Any]]:
    """Per layout: evaluation steps and the KL/ppl mean over seeds (steps all seeds share)."""
    by_layout: dict[str, dict[int, dict[int, EvalRecord]]] = {}
    for r in records:
        by_layout.setdefault(r.layout, {}).setdefault(r.seed, {})[r.step] = r
    curves = {}
    for name, seeds in by_layout.items():
        steps = sorted(set.intersection(*(set(v) for v in seeds.values())))
        per_seed = {str(seed): {"kl": [runs[s].kl for s in steps], "ppl": [runs[s].ppl for s in steps]}
                    for seed, runs in sorted(seeds.items())}  # str keys: the summary is JSON
        curves[name] = {
            "steps": steps,
            "kl": [float(np.mean([seeds[sd][s].kl for sd in seeds])) for s in steps],
            "ppl": [float(np.mean([seeds[sd][s].ppl for sd in seeds])) for s in steps],
            "kl_sd": [float(np.std([seeds[sd][s].kl for sd in seeds], ddof=1)) if len(seeds) > 1 else 0.0
                      for s in steps],
            "seeds": per_seed,
        }
    return curves


def headline(curves: dict[str, dict[str, Any]], *, reference: str, candidate: str) -> dict[str, Any] | None:
    """The paper's figures: when `candidate` reaches `reference`'s final KL, and the multiplier per eval."""
    if reference not in curves or candidate not in curves:
        return None
    ref, cand = curves[reference], curves[candidate]
    final_step, final_kl = ref["steps"][-1], ref["kl"][-1]
    rows = multipliers((ref["steps"], ref["kl"]), (cand["steps"], cand["kl"]))
    return {"reference": reference, "candidate": candidate,
            "reference_final_step": final_step, "reference_final_kl": final_kl,
            "candidate_final_kl": cand["kl"][-1],
            "candidate_step_to_reference_final_kl": reach_step(cand["steps"], cand["kl"], final_kl),
            "multipliers": rows}


def summarise(records: Sequence[EvalRecord], *, spec: DistillSpec, dense_ppl: float, model_id: str,
              layouts: dict[str, Layout], seconds: float) -> dict[str, Any]:
    curves = _mean_curves(records)
    return _json_safe({
        "format": SUMMARY_FORMAT,
        "model": model_id,
        "devices": spec.devices,
        "delta": spec.delta,
        "seeds": list(spec.seeds),
        "recipe": spec.recipe.as_dict(),
        "train": asdict(spec.train),
        "eval": asdict(spec.eval),
        "dense_ppl": dense_ppl,
        "layouts": {name: {**curves[name], "J": (layouts[name].score or {}).get("J")}
                    for name in spec.layouts if name in curves},
        "headline": headline(curves, reference=spec.reference, candidate=spec.candidate),
        "seconds": round(seconds, 1),
    })


def summary_table(summary: dict[str, Any]) -> str:
    """KL and perplexity per layout at each evaluation, then the headline, as plain text."""
    layouts = summary["layouts"]
    if not layouts:
        return "no runs"
    steps = next(iter(layouts.values()))["steps"]
    lines = [f"{'layout':<16}{'J':>8}  " + "".join(f"{'KL@' + str(s):>10}" for s in steps)]
    for name, c in layouts.items():
        j = f"{c['J']:.2f}" if c.get("J") is not None else "-"
        lines.append(f"{name:<16}{j:>8}  " + "".join(f"{k:>10.4f}" for k in c["kl"]))
    lines.append(f"{'':<16}{'':>8}  " + "".join(f"{'ppl@' + str(s):>10}" for s in steps))
    for name, c in layouts.items():
        lines.append(f"{name:<16}{'':>8}  " + "".join(f"{p:>10.2f}" for p in c["ppl"]))
    lines.append(f"dense perplexity {summary['dense_ppl']:.3f}")
    head = summary.get("headline")
    if head:
        reach = head["candidate_step_to_reference_final_kl"]
        lines.append(f"{head['candidate']} reaches {head['reference']}'s final KL "
                     f"{head['reference_final_kl']:.4f} (step {head['reference_final_step']}) at step "
                     + (f"{reach:.0f}" if reach is not None else "— (not reached)"))
        mults = [f"{r['step']}: " + (f"{r['multiplier']:.2f}×" if r["multiplier"] is not None else "—")
                 for r in head["multipliers"]]
        lines.append("compute multiplier per evaluation: " + ", ".join(mults))
    return "\n".join(lines)


def plot_curves(summary: dict[str, Any], path: Path) -> Path:
    """KL and perplexity against step, one line per layout (seed mean bold, seeds faint)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, (name, c) in enumerate(summary["layouts"].items()):
        color = f"C{i}"
        for metric, ax in zip(("kl", "ppl"), axes, strict=True):
            ax.plot(c["steps"], c[metric], color=color, lw=2, label=name, marker="o", ms=3)
            if len(c["seeds"]) > 1:
                for seed_curve in c["seeds"].values():
                    ax.plot(c["steps"], seed_curve[metric], color=color, lw=0.8, alpha=0.35)
    axes[1].axhline(summary["dense_ppl"], color="k", ls="--", lw=1, label="dense")
    axes[0].set_ylabel("KL to the dense model (nats/token)")
    axes[1].set_ylabel("perplexity")
    for ax in axes:
        ax.set_xlabel("training step")
        ax.set_yscale("log")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    fig.suptitle(f"{summary['model']}: L={summary['devices']}, δ={summary['delta']}", fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    plt.close(fig)
    _atomic_write_bytes(path, buf.getvalue())
    return path


# ---- layouts by name ---------------------------------------------------------------------------

def _random_seed(name: str) -> int | None:
    for prefix in ("random-", "random:"):
        if name.startswith(prefix):
            try:
                return int(name[len(prefix):])
            except ValueError:
                return None
    return None


def resolve_layout(name: str, *, shape: ModelShape, devices: int, delta: int,
                   layouts_dir: Path | None = None) -> Layout:
    """`contiguous`, `random-<seed>`/`random:<seed>`, a JSON path, or `<name>` from layouts_dir/<name>.json."""
    layout_mod.check_devices(shape, devices)
    layout_mod.check_delta(shape, delta)
    seed = _random_seed(name)
    if seed is not None:
        name = f"random-{seed}"  # random:SEED and random-SEED are one layout, named as `optimise` names it
    stored = Path(layouts_dir) / f"{name}.json" if layouts_dir is not None else None
    if stored is not None and stored.is_file():  # an optimise output: the same layout, with its score
        return _fit(layout_mod.load(stored), name, shape, devices, delta)
    if name == "contiguous":
        return layout_mod.contiguous(shape, devices, delta)
    if seed is not None:
        return layout_mod.random(shape, devices, delta, seed)
    if name.endswith(".json") or Path(name).is_file():
        lay = layout_mod.load(name)
        return _fit(lay, lay.name, shape, devices, delta)
    where = f"{layouts_dir}" if layouts_dir is not None else "no layouts directory given (--from DIR)"
    known = sorted(p.stem for p in Path(layouts_dir).glob("*.json")) if layouts_dir is not None else []
    raise LayoutError(f"layout {name!r}: not contiguous, random-<seed> or a JSON file, and not found in {where}"
                      + (f" (it has: {', '.join(known)})" if known else ""))


def _fit(lay: Layout, name: str, shape: ModelShape, devices: int, delta: int) -> Layout:
    layout_mod.check_fits(lay, shape)
    if lay.devices != devices:
        raise LayoutError(f"layout {name!r} has devices={lay.devices}, but the run asks for {devices}")
    return Layout(name, devices, delta, lay.shape, lay.kv_group_device, lay.neuron_device, lay.score)


def resolve_layouts(names: Sequence[str], *, shape: ModelShape, devices: int, delta: int,
                    layouts_dir: Path | None = None) -> dict[str, Layout]:
    layouts: dict[str, Layout] = {}
    for name in names:
        lay = resolve_layout(name, shape=shape, devices=devices, delta=delta, layouts_dir=layouts_dir)
        if lay.name in layouts:
            raise DistillError(f"layouts: two entries are named {lay.name!r}")
        layouts[lay.name] = lay
    return layouts


# ---- the whole comparison ----------------------------------------------------------------------

def load_data(spec: DistillSpec, *, tokenizer: Any, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Training and evaluation blocks; evaluation skips past the training text when they share a source."""
    train_spec = replace(spec.train, seed=0)  # the block order belongs to each run's seed
    eval_spec = spec.eval
    if eval_spec.source == train_spec.source:
        train_tokens = (train_spec.sequences + train_spec.skip_blocks) * train_spec.seq_len
        skip = max(eval_spec.skip_blocks, -(-train_tokens // eval_spec.seq_len))
        eval_spec = replace(eval_spec, skip_blocks=skip)
    return (load_blocks(train_spec, tokenizer, vocab_size=vocab_size),
            load_blocks(eval_spec, tokenizer, vocab_size=vocab_size))


def _write_metrics(out_dir: Path, records: Sequence[EvalRecord]) -> None:
    _atomic_write_text(out_dir / "metrics.csv", _csv_text(METRIC_COLUMNS, [r.as_dict() for r in records]))


def run_dir_for(out_dir: Path, layout: str, seed: int) -> Path:
    return Path(out_dir) / "runs" / layout.replace("/", "_") / f"seed-{seed}"


def run_distill(spec: DistillSpec, *, teacher: nn.Module, tokenizer: Any, out_dir: Path,
                layouts_dir: Path | None = None, model_id: str = "", progress: Progress | None = None,
                should_stop: ShouldStop | None = None, on_eval: Callable[[EvalRecord], None] | None = None,
                on_step: Callable[[str, int, StepStats, EvalRecord | None], None] | None = None,
                on_run_start: Callable[[str, int], None] | None = None, plot: bool = True,
                keep_checkpoints: bool = True) -> dict[str, Any]:
    """Every (layout, seed) run of `spec`, in order; writes out_dir/{metrics.csv, summary.json, curves.png}.

    Rerunning with the same spec and out_dir skips finished runs and resumes the interrupted one.
    progress(stage, fraction) counts optimiser steps over all runs. Returns the summary.
    """
    t0 = time.perf_counter()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    teacher.eval()
    config: Any = teacher.config
    layouts = resolve_layouts(spec.layouts, shape=model_shape(config), devices=spec.devices, delta=spec.delta,
                              layouts_dir=layouts_dir)
    vocab = int(config.vocab_size)
    train_blocks, eval_blocks = load_data(spec, tokenizer=tokenizer, vocab_size=vocab)
    reference = DenseReference.compute(teacher, eval_blocks, recipe=spec.recipe)
    pairs = [(name, seed) for name in layouts for seed in spec.seeds]
    records: list[EvalRecord] = []

    def record(rec: EvalRecord) -> None:
        records[:] = [r for r in records if (r.layout, r.seed, r.step) != (rec.layout, rec.seed, rec.step)]
        records.append(rec)
        _write_metrics(out_dir, records)
        if on_eval:
            on_eval(rec)

    def restored(earlier: list[EvalRecord]) -> None:
        for rec in earlier:
            records[:] = [r for r in records if (r.layout, r.seed, r.step) != (rec.layout, rec.seed, rec.step)]
        records.extend(earlier)
        _write_metrics(out_dir, records)

    for index, (name, seed) in enumerate(pairs):
        def run_progress(stage: str, fraction: float, index: int = index) -> None:
            if progress:
                progress(stage, (index + fraction) / len(pairs))

        def step_hook(stats: StepStats, last: EvalRecord | None, name: str = name, seed: int = seed) -> None:
            if on_step:
                on_step(name, seed, stats, last)

        if on_run_start:
            on_run_start(name, seed)
        result = distill_run(teacher=teacher, layout=layouts[name], seed=seed, recipe=spec.recipe,
                             train_blocks=train_blocks, reference=reference,
                             run_dir=run_dir_for(out_dir, name, seed), model_id=model_id, progress=run_progress,
                             should_stop=should_stop, on_eval=record, on_step=step_hook, on_restore=restored,
                             keep_checkpoint=keep_checkpoints)
        records[:] = [r for r in records if (r.layout, r.seed) != (name, seed)] + result.records
        _write_metrics(out_dir, records)
    summary = summarise(records, spec=spec, dense_ppl=reference.dense_ppl, model_id=model_id, layouts=layouts,
                        seconds=time.perf_counter() - t0)
    _atomic_write_text(out_dir / "summary.json", json.dumps(summary, indent=1))
    if plot:
        plot_curves(summary, out_dir / "curves.png")
    return summary


def remove_runs(out_dir: Path) -> None:
    """Forget every run under out_dir (for --overwrite)."""
    shutil.rmtree(Path(out_dir) / "runs", ignore_errors=True)
    for name in ("metrics.csv", "summary.json", "curves.png"):
        (Path(out_dir) / name).unlink(missing_ok=True)


def iter_records(summary: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Flat (layout, seed, step, kl, ppl) rows of a summary, for tables."""
    for name, c in summary["layouts"].items():
        for seed, curve in c["seeds"].items():
            for s, kl, ppl in zip(c["steps"], curve["kl"], curve["ppl"], strict=True):
                yield {"layout": name, "seed": int(seed), "step": s, "kl": kl, "ppl": ppl}

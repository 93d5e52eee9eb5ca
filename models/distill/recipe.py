"""The distillation recipe: every number of the training, the paper's by default (§4 and appendix).

Loss per token KL(teacher ‖ student) + 0.1·CE; AdamW β = (0.9, 0.95) without weight decay; lr 5e-5
with 100 linear warm-up steps and cosine decay to 5e-6; gradient clipping at 1; embeddings frozen;
fp32 master weights with bf16 autocast on CUDA (plain fp32 on CPU); 16 sequences of 1024 tokens per
step through micro-batches of 4; 1000 steps, evaluated every 100 on 16 blocks of WikiText-2 test.

Each field carries its own rule (type, bounds, one-line doc) as dataclass metadata: `DistillRecipe`
enforces them, and a request schema can build its fields from `DistillRecipe.rules()` instead of
mirroring them; the `dtp-layout distill` flags are the rules' own (the rule is models/base/fields.py's,
shared with the job spec, models/run/jobspec.py). Torch-free: the API process imports this module.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal

from models.base.fields import FieldRule, Flag, Kind  # noqa: F401  (Kind: importable from here as before)

Autocast = Literal["auto", "bf16", "none"]
LastScale = Literal["sqrt", "one"]  # models.sim.dtp.LastScale, restated here to stay torch-free
AUTOCASTS: tuple[str, ...] = ("auto", "bf16", "none")
LAST_SCALES: tuple[str, ...] = ("sqrt", "one")

MAX_STEPS = 10_000_000
MAX_SEQUENCES = 65_536  # sequences per step, micro-batch or evaluation batch
# Tokens in one forward of a distillation (a training micro-batch, an evaluation batch): micro_batch_size
# and eval_batch_size are cut to it, so that the memory a forward holds is bounded whatever the spec asks
# (a sequence longer than this is one forward of its own). 4× the paper's 4 × 1024.
MAX_FORWARD_TOKENS = 1 << 14
MAX_LOGIT_CHUNK = MAX_FORWARD_TOKENS  # a chunk never spans forwards: more could never be used

# The paper's data protocol for a comparison (§4): training blocks of 1024 tokens, evaluation on 16
# blocks of the WikiText-2 test set (an `hf:` source, streamed with the `datasets` package).
SEQ_LEN = 1024
EVAL_SEQUENCES = 16
WIKITEXT2_TEST = "hf:Salesforce/wikitext:wikitext-2-raw-v1:test"


class DistillError(ValueError):
    """A distillation request that cannot run as given (bad recipe, layouts, or run directory)."""


def _int(default: int, doc: str, *, ge: int, le: int, flags: tuple[Flag, ...] = ()) -> Any:
    return field(default=default, metadata={"rule": FieldRule("int", doc, ge=ge, le=le, flags=flags)})


def _float(default: float, doc: str, *, ge: float | None = None, gt: float | None = None,
           flags: tuple[Flag, ...] = ()) -> Any:
    return field(default=default, metadata={"rule": FieldRule("float", doc, ge=ge, gt=gt, flags=flags)})


def _bool(default: bool, doc: str, flags: tuple[Flag, ...] = ()) -> Any:
    return field(default=default, metadata={"rule": FieldRule("bool", doc, flags=flags)})


def _choice(default: str, doc: str, choices: tuple[str, ...], flags: tuple[Flag, ...] = ()) -> Any:
    return field(default=default, metadata={"rule": FieldRule("choice", doc, choices=choices, flags=flags)})


def _distill(*names: str, **kwargs: Any) -> tuple[Flag, ...]:
    """The flag of `dtp-layout distill` that sets a recipe field (`client submit` generates its own,
    `--distill-recipe-NAME`, unless `submit` names one)."""
    submit = kwargs.pop("submit", None)
    flags = (Flag(names, ("distill",), **kwargs),)
    return flags + ((Flag((submit,), ("submit",)),) if submit else ())


def _is_real(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclass(frozen=True)
class DistillRecipe:
    """Every number of the training recipe; the defaults are the paper's."""

    steps: int = _int(1000, "optimiser steps per run", ge=1, le=MAX_STEPS, flags=_distill("--steps"))
    batch_size: int = _int(16, "sequences per optimiser step", ge=1, le=MAX_SEQUENCES,
                           flags=_distill("--batch-size"))
    micro_batch_size: int = _int(4, "sequences per forward/backward (gradient accumulation); divides batch_size; "
                                    f"at most {MAX_FORWARD_TOKENS} tokens are used per forward", ge=1, le=MAX_SEQUENCES,
                                 flags=_distill("--micro-batch-size"))
    lr: float = _float(5e-5, "peak learning rate", gt=0, flags=_distill("--lr", submit="--lr"))
    min_lr: float = _float(5e-6, "end of the cosine decay; 0 < min_lr ≤ lr", gt=0, flags=_distill("--min-lr"))
    warmup_steps: int = _int(100, "linear warm-up steps", ge=0, le=MAX_STEPS, flags=_distill("--warmup"))
    betas: tuple[float, float] = field(default=(0.9, 0.95), metadata={
        "rule": FieldRule("betas", "AdamW betas, each in [0, 1)", ge=0, lt=1, flags=(
            Flag(("--beta1",), ("distill",), help="AdamW beta1, in [0, 1)"),
            Flag(("--beta2",), ("distill",), help="AdamW beta2, in [0, 1)")))})
    adam_eps: float = _float(1e-8, "AdamW epsilon", gt=0, flags=_distill("--adam-eps"))
    weight_decay: float = _float(0.0, "AdamW weight decay", ge=0, flags=_distill("--weight-decay"))
    grad_clip: float = _float(1.0, "max global gradient norm; 0 turns clipping off", ge=0,
                              flags=_distill("--grad-clip"))
    ce_weight: float = _float(0.1, "loss = KL + ce_weight · CE", ge=0, flags=_distill("--ce-weight"))
    freeze_embeddings: bool = _bool(True, "freeze the input embeddings (a tied LM head is the embedding matrix "
                                          "and is frozen with it)",
                                    flags=_distill("--train-embeddings", form="off",
                                                   help="do not freeze the input embeddings"))
    freeze_lm_head: bool = _bool(False, "also freeze an untied LM head (it trains otherwise)",
                                 flags=_distill("--freeze-lm-head", form="on"))
    autocast: Autocast = _choice("auto", "auto: bf16 autocast on CUDA, fp32 on CPU", AUTOCASTS,  # noqa: RUF009
                                 flags=_distill("--autocast"))
    gradient_checkpointing: bool = _bool(False, "recompute modules in backward (less memory, same gradients)",
                                         flags=_distill("--gradient-checkpointing", form="on"))
    logit_chunk: int = _int(256, "tokens per chunk of the loss over the vocabulary", ge=1, le=MAX_LOGIT_CHUNK,
                            flags=_distill("--logit-chunk"))
    eval_every: int = _int(100, "steps between evaluations; also at step 0 and the last", ge=1, le=MAX_STEPS,
                           flags=_distill("--eval-every", submit="--eval-every"))
    eval_batch_size: int = _int(4, f"evaluation sequences per forward (at most {MAX_FORWARD_TOKENS} tokens are used "
                                   "per forward)", ge=1, le=MAX_SEQUENCES, flags=_distill("--eval-batch-size"))
    checkpoint_every: int = _int(5, "evaluations between checkpoints (the last step is always checkpointed)",
                                 ge=1, le=MAX_STEPS, flags=_distill("--checkpoint-every"))
    last_scale: LastScale = _choice("sqrt", "DTP last-module scale", LAST_SCALES,  # noqa: RUF009
                                    flags=_distill("--last-scale"))

    def __post_init__(self) -> None:
        for name, rule in self.rules().items():
            object.__setattr__(self, name, _checked(name, rule, getattr(self, name)))
        if self.batch_size % self.micro_batch_size:
            raise DistillError(f"recipe.batch_size={self.batch_size} must be a multiple of "
                               f"micro_batch_size={self.micro_batch_size}")
        if not self.min_lr <= self.lr:
            raise DistillError(f"recipe needs 0 < min_lr ≤ lr, got lr={self.lr}, min_lr={self.min_lr}")

    @classmethod
    def rules(cls) -> dict[str, FieldRule]:
        """Each field's rule, in field order."""
        return {f.name: f.metadata["rule"] for f in fields(cls)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DistillRecipe:
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise DistillError(f"recipe: unknown field(s) {', '.join(sorted(unknown))}")
        return cls(**data)

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["betas"] = list(self.betas)
        return out

    def eval_steps(self) -> list[int]:
        """The steps after which a run evaluates: 0, every eval_every, and the last."""
        steps = list(range(0, self.steps + 1, self.eval_every))
        return steps if steps[-1] == self.steps else [*steps, self.steps]

    def evaluations(self) -> int:
        """len(eval_steps()) without building the list (a budget check at submit)."""
        return self.steps // self.eval_every + 1 + (1 if self.steps % self.eval_every else 0)

    def train_rows(self, seq_len: int) -> int:
        """Sequences per training forward: micro_batch_size, within MAX_FORWARD_TOKENS."""
        return forward_rows(self.micro_batch_size, seq_len)

    def eval_rows(self, seq_len: int) -> int:
        """Sequences per evaluation forward: eval_batch_size, within MAX_FORWARD_TOKENS."""
        return forward_rows(self.eval_batch_size, seq_len)

    def use_bf16(self, device_type: str) -> bool:
        """Whether the forward passes autocast to bf16 on this device type (`cuda`, `cpu`, …)."""
        return self.autocast == "bf16" or (self.autocast == "auto" and device_type == "cuda")


def forward_rows(sequences: int, seq_len: int) -> int:
    """`sequences` per forward cut to MAX_FORWARD_TOKENS tokens of `seq_len` each, and at least one."""
    return max(1, min(sequences, MAX_FORWARD_TOKENS // seq_len))


def _checked(name: str, rule: FieldRule, value: Any) -> Any:
    """The value as the recipe stores it (floats as float, betas as a tuple), or DistillError."""
    if rule.kind == "int":
        if not isinstance(value, int) or isinstance(value, bool) or not rule.within(value):
            raise DistillError(f"recipe.{name} must be an integer {rule.bounds_text()}, got {value!r}")
        return value
    if rule.kind == "float":
        if not _is_real(value) or not math.isfinite(value) or not rule.within(value):
            raise DistillError(f"recipe.{name} must be a finite number {rule.bounds_text()}, got {value!r}")
        return float(value)
    if rule.kind == "bool":
        if not isinstance(value, bool):
            raise DistillError(f"recipe.{name} must be true or false, got {value!r}")
        return value
    if rule.kind == "choice":
        if value not in rule.choices:
            raise DistillError(f"recipe.{name} must be {', '.join(rule.choices[:-1])} or {rule.choices[-1]}, "
                               f"got {value!r}")
        return value
    ok = (isinstance(value, Sequence) and not isinstance(value, str) and len(value) == 2
          and all(_is_real(b) and math.isfinite(b) and rule.within(b) for b in value))
    if not ok:
        raise DistillError(f"recipe.{name} must be two numbers in [0, 1), got {value!r}")
    return tuple(float(b) for b in value)

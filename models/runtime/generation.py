"""What a generation asks for and what it returns (plain data: sent between processes as is)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from models.runtime.errors import ShardError
from models.schedules.grammar import ScheduleError, parse_schedule, resolve_schedule

LAST_SCALES = ("sqrt", "one")


@dataclass(frozen=True)
class LoadInfo:
    """What a rank loaded (every rank reports its own; they agree on all but rank, device and bytes)."""

    rank: int
    device: str
    shards_dir: str
    model_type: str
    layout: str
    devices: int
    delta: int  # the layout's δ
    num_layers: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    dtype: str
    shard_bytes: int
    load_s: float
    schedule: str = "dtp:1"  # the schedule the shards were made for (the manifest's; before it: dtp:δ)


@dataclass(frozen=True)
class GenerateRequest:
    input_ids: np.ndarray  # [B, S] int64
    max_new_tokens: int = 32
    # The schedule to run: None runs the shards' own; another one is refused unless `override` (a timing
    # baseline, e.g. tp on DTP shards: the tokens are then not the exported model's).
    schedule: str | None = None
    override: bool = False
    last_scale: str = "sqrt"
    temperature: float = 0.0
    top_k: int | None = None
    seed: int = 0
    stop_ids: tuple[int, ...] = ()
    link_latency_us: float = 0.0
    return_logits: bool = False

    def checked(self, info: LoadInfo) -> GenerateRequest:
        """Raise ValueError naming the bad field (ShardError: shards made for another schedule); returns the
        request with the schedule filled in, canonical."""
        ids = self.input_ids
        if not isinstance(ids, np.ndarray) or ids.ndim != 2 or ids.shape[0] < 1 or ids.shape[1] < 1:
            raise ValueError("input_ids must be a non-empty [batch, tokens] integer array "
                             f"(got {getattr(ids, 'shape', type(ids).__name__)})")
        if not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"input_ids must be integers, got {ids.dtype}")
        if ids.min() < 0 or ids.max() >= info.vocab_size:
            raise ValueError(f"input_ids must lie in [0, vocab_size={info.vocab_size}), "
                             f"found {int(ids.min())}..{int(ids.max())}")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if self.last_scale not in LAST_SCALES:
            raise ValueError(f"last_scale must be 'sqrt' or 'one', got {self.last_scale!r}")
        schedule = checked_schedule(self.schedule, self.override, info, self.last_scale)
        if not self.link_latency_us >= 0:
            raise ValueError(f"link_latency_us must be >= 0, got {self.link_latency_us}")
        if self.temperature < 0 or (self.top_k is not None and self.top_k < 1):
            raise ValueError(f"temperature must be >= 0 and top_k >= 1, got {self.temperature}, {self.top_k}")
        return GenerateRequest(ids.astype(np.int64), self.max_new_tokens, schedule, self.override, self.last_scale,
                               self.temperature, self.top_k, self.seed, tuple(self.stop_ids), self.link_latency_us,
                               self.return_logits)


def checked_schedule(requested: str | None, override: bool, info: LoadInfo, last_scale: str = "sqrt") -> str:
    """The canonical schedule to run: the shards' own unless `requested` (which must then be the same
    schedule, i.e. the same table, unless `override`)."""
    try:
        own = resolve_schedule(info.schedule, info.num_layers, info.devices, last_scale)  # type: ignore[arg-type]
        if requested is None:
            return own.name
        wanted = resolve_schedule(requested, info.num_layers, info.devices, last_scale)  # type: ignore[arg-type]
    except ScheduleError as exc:
        raise ValueError(f"schedule: {exc}") from exc
    same = (own.own_arrival, own.own_scale, own.other_arrival) == (
        wanted.own_arrival, wanted.own_scale, wanted.other_arrival)
    if not same and not override:
        raise ShardError(f"{info.shards_dir}: the shards were made for schedule {own.name!r}, not {wanted.name!r}: "
                         f"run them at {own.name!r} (or export the model for {wanted.name!r}; to time them at "
                         f"another schedule anyway, e.g. as a baseline, use --schedule-override)")
    return wanted.name


def schedule_delta(schedule: str) -> int | None:
    """δ of a dtp:δ schedule (no @K), else None; `schedule` is a checked request's (canonical)."""
    spec = parse_schedule(schedule)
    return spec.delta if spec.kind == "dtp" and spec.upper is None else None


@dataclass(frozen=True)
class RankStats:
    """One rank's timings. Decode figures are per generated token after the first (prefill excluded)."""

    rank: int
    prefill_ms: float
    prefill_blocked_ms: float
    decode_steps: int
    ms_per_token: float | None
    blocked_ms_per_token: float | None  # every wait: module exchanges, final reduction, token broadcast
    exchange_blocked_ms_per_token: float | None  # waits on the module exchanges alone
    exchanges_per_token: float | None


@dataclass
class GenerationResult:
    prompt_ids: np.ndarray  # [B, S]
    tokens: np.ndarray  # [B, N] generated ids (after a stop token, a finished sequence repeats it)
    devices: int
    schedule: str  # the schedule run (canonical)
    delta: int | None  # its δ when it is dtp:δ
    backend: str
    link_latency_us: float
    sampling: dict[str, Any]
    ranks: list[RankStats]
    prefill_logits: np.ndarray | None = None  # [B, S, V] with return_logits
    step_logits: np.ndarray | None = None  # [N-1, B, V]: the logits of each decode step
    text: list[str] | None = field(default=None)  # the generated text per sequence, when a tokenizer is present

    @property
    def ms_per_token(self) -> float | None:
        """The slowest rank's decode time per token (the ranks run in lockstep)."""
        values = [r.ms_per_token for r in self.ranks if r.ms_per_token is not None]
        return max(values) if values else None

    def as_dict(self) -> dict[str, Any]:
        """The `--json` output: ids, text and per-rank timings (no logits)."""
        return {
            "prompt_ids": self.prompt_ids.tolist(),
            "generated_ids": self.tokens.tolist(),
            "text": self.text,
            "devices": self.devices,
            "schedule": self.schedule,
            "delta": self.delta,
            "mode": "tensor-parallel" if self.schedule in ("tp", "dtp:0") else "dtp" if self.delta is not None
            else parse_schedule(self.schedule).kind,
            "backend": self.backend,
            "link_latency_us": self.link_latency_us,
            "sampling": self.sampling,
            "ranks": [asdict(r) for r in self.ranks],
        }


def combine_errors(failures: list[tuple[int, str]]) -> str:
    """One message for the errors of several ranks (identical ones once, with the ranks that gave them)."""
    by_message: dict[str, list[int]] = {}
    for rank, message in failures:
        by_message.setdefault(message, []).append(rank)
    parts = []
    for message, ranks in by_message.items():
        who = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
        parts.append(f"{who}: {message}")
    return "; ".join(parts)


def shard_error(failures: list[tuple[int, str]]) -> ShardError:
    return ShardError(combine_errors(failures))

"""What a generation asks for and what it returns (plain data: sent between processes as is)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from models.runtime.errors import ShardError

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
    delta: int
    num_layers: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    dtype: str
    shard_bytes: int
    load_s: float


@dataclass(frozen=True)
class GenerateRequest:
    input_ids: np.ndarray  # [B, S] int64
    max_new_tokens: int = 32
    delta: int | None = None  # None: the manifest's δ; 0: standard tensor parallelism
    last_scale: str = "sqrt"
    temperature: float = 0.0
    top_k: int | None = None
    seed: int = 0
    stop_ids: tuple[int, ...] = ()
    link_latency_us: float = 0.0
    return_logits: bool = False

    def checked(self, info: LoadInfo) -> GenerateRequest:
        """Raise ValueError naming the bad field; returns the request with δ filled in."""
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
        delta = info.delta if self.delta is None else self.delta
        if not isinstance(delta, int) or not 0 <= delta <= info.num_layers:
            raise ValueError(f"delta must be an integer in [0, num_layers={info.num_layers}] (0 = standard tensor "
                             f"parallelism), got {delta!r}")
        if self.last_scale not in LAST_SCALES:
            raise ValueError(f"last_scale must be 'sqrt' or 'one', got {self.last_scale!r}")
        if not self.link_latency_us >= 0:
            raise ValueError(f"link_latency_us must be >= 0, got {self.link_latency_us}")
        if self.temperature < 0 or (self.top_k is not None and self.top_k < 1):
            raise ValueError(f"temperature must be >= 0 and top_k >= 1, got {self.temperature}, {self.top_k}")
        return GenerateRequest(ids.astype(np.int64), self.max_new_tokens, delta, self.last_scale, self.temperature,
                               self.top_k, self.seed, tuple(self.stop_ids), self.link_latency_us, self.return_logits)


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
    delta: int
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
            "delta": self.delta,
            "mode": "tensor-parallel" if self.delta == 0 else "dtp",
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

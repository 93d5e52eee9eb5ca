"""A schedule resolved for a model: the per-module (b_n, s_n, a_n) table every consumer reads (the
simulator, the objective, the runtime, the vLLM plugin, manifests). Torch-free; see `grammar` for the
presets that produce it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from models.base.layout_format import LayoutError

__all__ = ["NEVER", "LastScale", "Schedule", "ScheduleError"]

NEVER = None  # a_n = ∞: module n's partial never reaches the other devices

LastScale = Literal["sqrt", "one"]


class ScheduleError(LayoutError):
    """A schedule string or table that cannot be used (the message names the bad part)."""


@dataclass(frozen=True)
class Schedule:
    """A schedule resolved for a model: per module n, b_n (`own_arrival`), s_n (`own_scale`), a_n
    (`other_arrival`, `NEVER` for ∞). Validated on construction, so a hand-built table is safe too."""

    name: str  # the canonical schedule string
    devices: int
    own_arrival: tuple[int, ...]
    own_scale: tuple[float, ...]
    other_arrival: tuple[int | None, ...]
    last_scale: LastScale = "sqrt"
    # Per arrival point t = 0 .. M: the modules whose own / others' partials enter before module t.
    _own_at: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)
    _others_at: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        M = len(self.own_arrival)
        if M == 0 or M % 2 or len(self.own_scale) != M or len(self.other_arrival) != M:
            raise ScheduleError(f"schedule {self.name!r}: own_arrival, own_scale and other_arrival must each "
                                f"have one entry per module (an even, positive count), got "
                                f"{M}, {len(self.own_scale)}, {len(self.other_arrival)}")
        for n in range(M):
            b, s, a = self.own_arrival[n], self.own_scale[n], self.other_arrival[n]
            if not n + 1 <= b <= M:
                raise ScheduleError(f"schedule {self.name!r}: module {n}'s own arrival b={b} must be in "
                                    f"{n + 1} .. {M}")
            if a is not NEVER and not n + 1 <= a <= M:
                raise ScheduleError(f"schedule {self.name!r}: module {n}'s others' arrival a={a} must be in "
                                    f"{n + 1} .. {M} or NEVER")
            if not math.isfinite(s):
                raise ScheduleError(f"schedule {self.name!r}: module {n}'s own scale must be finite, got {s}")
        own_at: list[list[int]] = [[] for _ in range(M + 1)]
        others_at: list[list[int]] = [[] for _ in range(M + 1)]
        for n in range(M):
            own_at[self.own_arrival[n]].append(n)
            a = self.other_arrival[n]
            if a is not NEVER:
                others_at[a].append(n)
        object.__setattr__(self, "_own_at", tuple(map(tuple, own_at)))
        object.__setattr__(self, "_others_at", tuple(map(tuple, others_at)))

    def __str__(self) -> str:
        return self.name

    @property
    def num_modules(self) -> int:
        return len(self.own_arrival)

    def own_arriving(self, t: int) -> tuple[int, ...]:
        """The modules m with b_m = t (ascending): their own partials enter before module t."""
        return self._own_at[t]

    def others_arriving(self, t: int) -> tuple[int, ...]:
        """The modules m with a_m = t (ascending): the other devices' partials enter before module t."""
        return self._others_at[t]

    def exchanged(self, n: int) -> bool:
        """Whether module n's partial ever reaches the other devices."""
        return self.other_arrival[n] is not NEVER

    @property
    def layout_independent(self) -> bool:
        """a_n = b_n and s_n = 1 for every n (tp, ladder): every device's stream holds the full sum, so
        the model computes the same function under every layout (the layout is irrelevant)."""
        table = zip(self.other_arrival, self.own_arrival, self.own_scale, strict=True)
        return all(a == b and s == 1.0 for a, b, s in table)

    @property
    def syncs_per_token(self) -> int:
        """Distinct exchange points per token: the module boundaries t ≤ M at which other devices'
        partials are received (the partials arriving at one point travel as one all-reduce of their
        sum). tp: M, dtp:δ: M-δ, ladder: M-1, spd:B: M-|B|, pt:D: ⌈layers/D⌉."""
        return sum(1 for arriving in self._others_at if arriving)

    def as_dict(self) -> dict[str, object]:
        """The table as JSON-able data (∞ as null), for manifests and reports."""
        return {"schedule": self.name, "devices": self.devices, "last_scale": self.last_scale,
                "own_arrival": list(self.own_arrival), "own_scale": list(self.own_scale),
                "other_arrival": list(self.other_arrival), "syncs_per_token": self.syncs_per_token,
                "layout_independent": self.layout_independent}

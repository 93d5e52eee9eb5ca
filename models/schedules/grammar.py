"""Communication schedules (issue 20): when each module's partial outputs enter each device's stream.

Torch-free: the declaration that the simulator (`models.sim.dtp`), and later the objective, the optimiser
and the runtime, all read. Modules n = 0 .. M-1, M = 2·layers (even n: attention of layer n/2; odd n:
its FFN). Device l computes its partial o_n^l of module n from its own stream X_l. A schedule gives,
for every module n,

    b_n   the own partial's arrival: the module before which o_n^l enters X_l, in n+1 .. M
    s_n   the own partial's scale
    a_n   the others' arrival: the module before which o_n^j (j ≠ l) enter X_l, in n+1 .. M, or ∞
          (`NEVER`): the partial is never exchanged

where M means "before the final norm". Before module t:

    X_l = X^(0) + Σ_{n : b_n ≤ t} s_n · o_n^l + Σ_{n : a_n ≤ t} Σ_{j ≠ l} o_n^j

and the output is lm_head(mean_l final_norm(X_l)) with every arrival ≤ M included.

The presets (`parse_schedule` reads them; `ScheduleSpec.resolve` turns one into the per-module table
of a model with `num_layers` layers on L devices):

    tp        a_n = b_n = n+1, s_n = 1: the dense model
    dtp:δ     the paper's eq. 2: b_n = n+1; s_n = √L for n < δ or n ≥ M-δ, else 1;
              a_n = n+δ+1 for n ≤ M-1-δ, else ∞ (δ in 0 .. layers)
    dtp:δ@K   partial conversion: the lower layers as tp, the upper K as dtp:δ (the √L scales at the
              first δ and the last δ modules of the converted part; δ in 0 .. K)
    ladder    a_n = b_n = min(n+2, M), s_n = 1 (Ladder Residual: every output enters one module late)
    spd:B     Sync-Point Drop at the layers B (a comma list): for n = 2i, i in B: b_n = n+1, s_n = 1,
              a_n = n+2 (the attention's others arrive after the FFN); every other module as tp
    spd:auto:K  SPD at K layers chosen by KL on calibration data, cumulatively (drop the least sensitive,
              re-measure the rest with it dropped, repeat); spd:isolated:K: the K whose dropped sync
              alone costs least (`models.schedules.spd_auto`). Parsed here, but they need that data to become
              spd:B (`ScheduleSpec.with_spd_layers`), so `resolve` refuses them
    pt:D      Parallel Track's sync pattern, blocks of D layers (2D modules): b_n = n+1, s_n = 1,
              a_n = min(2D·(⌊n/2D⌋+1), M) — on this dense model sharded as TP: each device's stream
              misses the others' partials until the block ends. Not Parallel Track's architecture, whose
              tracks are independent narrower Transformers trained so (docs/method.md)

`last_scale="one"` (the recipe's option) drops the √L on the last δ modules of dtp schedules; the
schedule string does not spell it, the recipe records it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Literal

from models.layouts.format import LayoutError

__all__ = ["ACCEPTED", "ACCEPTED_WITHOUT_AUTO", "NEVER", "Schedule", "ScheduleError", "ScheduleSpec", "dtp_spec",
           "parse_schedule", "resolve_schedule"]

NEVER = None  # a_n = ∞: module n's partial never reaches the other devices

ACCEPTED = ("tp, dtp:δ, dtp:δ@K, ladder, spd:B (B a comma list of layers, e.g. spd:1,3,5), spd:auto:K, "
            "spd:isolated:K, pt:D "
            "(δ, K, D non-negative integers: K, D ≥ 1)")
# What a command that cannot choose spd:auto:K's layers accepts (only `optimise` and a job's affinity stage
# run the sensitivity pass that chooses them).
ACCEPTED_WITHOUT_AUTO = ACCEPTED.replace(" spd:auto:K,", "").replace(" spd:isolated:K,", "")
MAX_SCHEDULE_CHARS = 4096  # a comma list of a few hundred layers; longer text is refused unread
_INT = re.compile(r"[0-9]{1,6}")  # bounded: no 10^6-digit integer is ever parsed

Kind = Literal["tp", "dtp", "ladder", "spd", "spd-auto", "pt"]
LastScale = Literal["sqrt", "one"]


class ScheduleError(LayoutError):
    """A schedule string is malformed, or its schedule does not fit the model."""


def _error(text: str, problem: str) -> ScheduleError:
    return ScheduleError(f"schedule {text!r}: {problem}; accepted: {ACCEPTED}")


def _integer(text: str, part: str, what: str, *, minimum: int) -> int:
    if not _INT.fullmatch(part):
        raise _error(text, f"{what} must be an integer ≥ {minimum}, got {part!r}")
    value = int(part)
    if value < minimum:
        raise _error(text, f"{what} must be an integer ≥ {minimum}, got {value}")
    return value


@dataclass(frozen=True)
class ScheduleSpec:
    """A parsed schedule, independent of the model: `str(spec)` is its canonical string."""

    kind: Kind
    delta: int = 0  # dtp
    upper: int | None = None  # dtp@K: the K converted (upper) layers; None: all layers
    layers: tuple[int, ...] = ()  # spd: the layers whose attention sync is dropped, ascending
    count: int = 0  # spd:auto:K
    rule: Literal["cumulative", "isolated"] = "cumulative"  # spd-auto: spd:auto:K, or spd:isolated:K
    block: int = 0  # pt:D: layers per track block

    def __str__(self) -> str:
        if self.kind == "dtp":
            return f"dtp:{self.delta}" + (f"@{self.upper}" if self.upper is not None else "")
        if self.kind == "spd":
            return "spd:" + ",".join(map(str, self.layers))
        if self.kind == "spd-auto":
            return f"spd:{'auto' if self.rule == 'cumulative' else 'isolated'}:{self.count}"
        if self.kind == "pt":
            return f"pt:{self.block}"
        return self.kind

    @property
    def resolvable(self) -> bool:
        """Whether the model's shape alone fixes the table (spd:auto:K also needs calibration data)."""
        return self.kind != "spd-auto"

    def with_spd_layers(self, layers: tuple[int, ...] | list[int]) -> ScheduleSpec:
        """spd:auto:K once its K layers are chosen: the spd:B it stands for."""
        if self.kind != "spd-auto":
            raise ScheduleError(f"schedule {str(self)!r} is not spd:auto:K")
        chosen = tuple(sorted(set(layers)))
        if len(chosen) != self.count or len(chosen) != len(layers):
            raise ScheduleError(f"{self}: needs {self.count} distinct layers, got {list(layers)}")
        return ScheduleSpec("spd", layers=chosen)

    def resolve(self, num_layers: int, devices: int, last_scale: LastScale = "sqrt") -> Schedule:
        """The per-module table for a model of `num_layers` layers on `devices` devices."""
        name = str(self)
        if not isinstance(num_layers, int) or num_layers < 1:
            raise ScheduleError(f"schedule {name!r}: num_layers must be a positive integer, got {num_layers!r}")
        if not isinstance(devices, int) or devices < 1:
            raise ScheduleError(f"schedule {name!r}: devices must be a positive integer, got {devices!r}")
        if last_scale not in ("sqrt", "one"):
            raise ValueError(f"last_scale must be 'sqrt' or 'one', got {last_scale!r}")
        M = 2 * num_layers
        if self.kind == "tp":
            return Schedule(name, devices, tuple(range(1, M + 1)), (1.0,) * M, tuple(range(1, M + 1)))
        if self.kind == "ladder":
            late = tuple(min(n + 2, M) for n in range(M))
            return Schedule(name, devices, late, (1.0,) * M, late)
        if self.kind == "dtp":
            upper = num_layers if self.upper is None else self.upper
            if upper > num_layers:
                raise ScheduleError(f"schedule {name!r}: K={upper} converted layers, but the model has "
                                    f"num_layers={num_layers}: K must be in 1 .. {num_layers}")
            if self.delta > upper:
                where = f"num_layers={num_layers}" if self.upper is None else f"K={upper}"
                raise ScheduleError(f"schedule {name!r}: δ={self.delta} must be in 0 .. {where} (modules are "
                                    f"counted two per layer)")
            return _dtp_table(name, devices, M, 2 * upper, self.delta, last_scale)
        if self.kind == "spd":
            beyond = [i for i in self.layers if i >= num_layers]
            if beyond:
                raise ScheduleError(f"schedule {name!r}: layers {beyond} do not exist: the model's layers are "
                                    f"0 .. {num_layers - 1}")
            dropped = [n + 1 for n in range(M)]
            for i in self.layers:
                dropped[2 * i] = 2 * i + 2
            return Schedule(name, devices, tuple(range(1, M + 1)), (1.0,) * M, tuple(dropped))
        if self.kind == "pt":
            if self.block > num_layers:
                raise ScheduleError(f"schedule {name!r}: D={self.block} layers per block, but the model has "
                                    f"num_layers={num_layers}: D must be in 1 .. {num_layers}")
            span = 2 * self.block
            others = tuple(min(span * (n // span + 1), M) for n in range(M))
            return Schedule(name, devices, tuple(range(1, M + 1)), (1.0,) * M, others)
        self.check_depth(num_layers)
        raise ScheduleError(f"schedule {name!r} needs calibration data: its K layers are chosen by the KL "
                            f"each layer's dropped sync costs on the calibration blocks (SPD's sensitivity "
                            f"rule, models.schedules.spd_auto: the affinity stage of optimise and of a job); "
                            f"resolve it there, or give the layers as spd:B")

    def check_depth(self, num_layers: int) -> None:
        """spd:auto:K before its layers are chosen: K must not exceed the model's layers."""
        if self.kind == "spd-auto" and self.count > num_layers:
            raise ScheduleError(f"schedule {str(self)!r}: K={self.count} layers to drop, but the model has "
                                f"num_layers={num_layers}: K must be in 1 .. {num_layers}")


def _dtp_table(name: str, devices: int, M: int, converted: int, delta: int, last_scale: LastScale) -> Schedule:
    """dtp:δ on the last `converted` modules, tp below them (converted = M: the paper's eq. 2)."""
    root = math.sqrt(devices)
    start = M - converted  # the first converted module
    scales: list[float] = []
    others: list[int | None] = []
    for n in range(M):
        k = n - start  # the module's index within the converted part
        if k < 0:
            scales.append(1.0)
            others.append(n + 1)
            continue
        first, last = k < delta, k >= converted - delta
        scales.append(root if first or (last and last_scale == "sqrt") else 1.0)
        others.append(n + delta + 1 if k <= converted - 1 - delta else NEVER)
    return Schedule(name, devices, tuple(range(1, M + 1)), tuple(scales), tuple(others), last_scale)


def parse_schedule(text: str) -> ScheduleSpec:
    """A schedule string (see the module doc) -> its spec; errors name the bad part and what is accepted."""
    if not isinstance(text, str):
        raise ScheduleError(f"schedule must be a string, got {type(text).__name__}; accepted: {ACCEPTED}")
    if len(text) > MAX_SCHEDULE_CHARS:
        raise ScheduleError(f"schedule is {len(text)} characters, at most {MAX_SCHEDULE_CHARS}; accepted: {ACCEPTED}")
    name, sep, rest = text.partition(":")
    if name in ("tp", "ladder"):
        if sep:
            raise _error(text, f"{name} takes no parameter, got {rest!r}")
        return ScheduleSpec(name)  # type: ignore[arg-type]
    if not sep and name in ("dtp", "spd", "pt"):
        raise _error(text, f"{name} needs a parameter after ':'")
    if name == "dtp":
        delta_part, at, upper_part = rest.partition("@")
        delta = _integer(text, delta_part, "δ", minimum=0)
        if not at:
            return ScheduleSpec("dtp", delta=delta)
        upper = _integer(text, upper_part, "K (the converted upper layers)", minimum=1)
        if delta > upper:
            raise _error(text, f"δ={delta} must be in 0 .. K={upper}")
        return ScheduleSpec("dtp", delta=delta, upper=upper)
    if name == "pt":
        return ScheduleSpec("pt", block=_integer(text, rest, "D (layers per block)", minimum=1))
    if name == "spd":
        if rest.startswith(("auto", "isolated")):
            head, colon, count = rest.partition(":")
            if head not in ("auto", "isolated") or not colon:
                raise _error(text, f"expected spd:auto:K or spd:isolated:K, got spd:{rest}")
            return ScheduleSpec("spd-auto", count=_integer(text, count, "K (layers to drop)", minimum=1),
                                rule="cumulative" if head == "auto" else "isolated")
        layers = [_integer(text, part, "each layer of B", minimum=0) for part in rest.split(",")]
        repeated = sorted({i for i in layers if layers.count(i) > 1})
        if repeated:
            raise _error(text, f"layers {repeated} are given more than once")
        return ScheduleSpec("spd", layers=tuple(sorted(layers)))
    raise _error(text, f"unknown schedule {name!r}")


def schedule_spec(schedule: str | ScheduleSpec) -> ScheduleSpec:
    """A schedule given as its string (a stored spec, a file's field, a flag) or already parsed: the spec."""
    return parse_schedule(schedule) if isinstance(schedule, str) else schedule


def dtp_spec(delta: int) -> ScheduleSpec:
    """`delta: δ` is the shorthand for `dtp:δ`."""
    return parse_schedule(f"dtp:{delta}")


def resolve_schedule(schedule: str | ScheduleSpec, num_layers: int, devices: int,
                     last_scale: LastScale = "sqrt") -> Schedule:
    """parse (if a string) and resolve for the model: the one entry point for callers with a string."""
    return schedule_spec(schedule).resolve(num_layers, devices, last_scale)


def check_schedule(schedule: str | ScheduleSpec, num_layers: int, devices: int) -> None:
    """What `resolve_schedule` checks against the model, for every schedule: spd:auto:K, whose layers the
    calibration data chooses later, only needs K ≤ num_layers now. A ScheduleError names what does not fit."""
    spec = schedule_spec(schedule)
    if spec.resolvable:
        spec.resolve(num_layers, devices)
    else:
        spec.check_depth(num_layers)


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

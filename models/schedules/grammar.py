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
of a model with `num_layers` layers on L devices; each is one class of `models.schedules.presets`, with
its parse, format and table, and the table is `models.schedules.table.Schedule`):

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
              alone costs least (`models.evaluation.spd_auto`). Parsed here, but they need that data to become
              spd:B (`ScheduleSpec.with_spd_layers`), so `resolve` refuses them
    pt:D      Parallel Track's sync pattern, blocks of D layers (2D modules): b_n = n+1, s_n = 1,
              a_n = min(2D·(⌊n/2D⌋+1), M) — on this dense model sharded as TP: each device's stream
              misses the others' partials until the block ends. Not Parallel Track's architecture, whose
              tracks are independent narrower Transformers trained so (docs/method.md)

`last_scale="one"` (the recipe's option) drops the √L on the last δ modules of dtp schedules; the
schedule string does not spell it, the recipe records it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from models.schedules.presets import (
    ACCEPTED,
    ACCEPTED_WITHOUT_AUTO,
    BY_KIND,
    BY_NAME,
    MAX_SCHEDULE_CHARS,
    accepted_forms,
    schedule_error,
)
from models.schedules.table import NEVER, LastScale, Schedule, ScheduleError

__all__ = ["ACCEPTED", "ACCEPTED_WITHOUT_AUTO", "MAX_SCHEDULE_CHARS", "NEVER", "LastScale", "Schedule",
           "ScheduleError", "ScheduleSpec", "accepted_forms", "check_schedule", "dtp_spec", "dtp_text",
           "parse_schedule", "resolve_schedule", "schedule_spec", "shorthand"]

Kind = Literal["tp", "dtp", "ladder", "spd", "spd-auto", "pt"]


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
        return BY_KIND[self.kind].format(self)

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
        return BY_KIND[self.kind].table(self, num_layers, devices, last_scale)

    def check_depth(self, num_layers: int) -> None:
        """spd:auto:K before its layers are chosen: K must not exceed the model's layers."""
        if self.kind == "spd-auto" and self.count > num_layers:
            raise ScheduleError(f"schedule {str(self)!r}: K={self.count} layers to drop, but the model has "
                                f"num_layers={num_layers}: K must be in 1 .. {num_layers}")


def parse_schedule(text: str) -> ScheduleSpec:
    """A schedule string (see the module doc) -> its spec; errors name the bad part and what is accepted."""
    if not isinstance(text, str):
        raise ScheduleError(f"schedule must be a string, got {type(text).__name__}; accepted: {ACCEPTED}")
    if len(text) > MAX_SCHEDULE_CHARS:
        raise ScheduleError(f"schedule is {len(text)} characters, at most {MAX_SCHEDULE_CHARS}; accepted: {ACCEPTED}")
    name, sep, rest = text.partition(":")
    preset = BY_NAME.get(name)
    if preset is None:
        raise schedule_error(text, f"unknown schedule {name!r}")
    if not preset.takes_parameter:
        if sep:
            raise schedule_error(text, f"{name} takes no parameter, got {rest!r}")
        return ScheduleSpec(preset.kind)  # type: ignore[arg-type]
    if not sep:
        raise schedule_error(text, f"{name} needs a parameter after ':'")
    if name == "spd" and rest.startswith(("auto", "isolated")):
        preset = BY_KIND["spd-auto"]
    return ScheduleSpec(preset.kind, **preset.parse(text, rest))  # type: ignore[arg-type]


def schedule_spec(schedule: str | ScheduleSpec) -> ScheduleSpec:
    """A schedule given as its string (a stored spec, a file's field, a flag) or already parsed: the spec."""
    return parse_schedule(schedule) if isinstance(schedule, str) else schedule


def dtp_text(delta: int) -> str:
    """dtp:δ's string, unchecked, where a string travels on (a rank's request, a manifest's field): with
    `dtp_spec`, the one place that spells dtp:δ from a δ."""
    return f"dtp:{delta}"


def dtp_spec(delta: int) -> ScheduleSpec:
    """`delta: δ` is the shorthand for `dtp:δ`."""
    return parse_schedule(dtp_text(delta))


def shorthand(schedule: ScheduleSpec | None, delta: int | None) -> str | None:
    """A schedule as the stores that keep the older `delta` + `schedule` pair write it (a job spec's fields, a
    distillation run's fingerprint): canonical, None where it is dtp:δ of `delta` (its shorthand)."""
    if schedule is None or (schedule.kind == "dtp" and schedule.upper is None and schedule.delta == delta):
        return None
    return str(schedule)


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



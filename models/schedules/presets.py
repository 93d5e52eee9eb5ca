"""The schedule presets as a registry: one class per preset, each with its parse (the text after
`NAME:` → the spec's fields), its format (the spec → its canonical string) and its table (the spec →
the per-module (b_n, s_n, a_n) of a model), and its forms (how its strings are written: `accepted_forms`
lists them for every error, help string and schema). A new preset is one class here plus its line in
`grammar`'s module doc. Torch-free."""

from __future__ import annotations

import math
import re
from collections.abc import Collection
from typing import TYPE_CHECKING, Any, ClassVar

from models.schedules.table import NEVER, LastScale, Schedule, ScheduleError

if TYPE_CHECKING:
    from models.schedules.grammar import ScheduleSpec

__all__ = ["ACCEPTED", "ACCEPTED_WITHOUT_AUTO", "BY_KIND", "BY_NAME", "LAYOUT_FREE", "MAX_SCHEDULE_CHARS", "Preset",
           "accepted_forms", "schedule_error"]

MAX_SCHEDULE_CHARS = 4096  # a comma list of a few hundred layers; longer text is refused unread
_INT = re.compile(r"[0-9]{1,6}")  # bounded: no 10^6-digit integer is ever parsed


def schedule_error(text: str, problem: str) -> ScheduleError:
    return ScheduleError(f"schedule {text!r}: {problem}; accepted: {ACCEPTED}")


def _integer(text: str, part: str, what: str, *, minimum: int) -> int:
    if not _INT.fullmatch(part):
        raise schedule_error(text, f"{what} must be an integer ≥ {minimum}, got {part!r}")
    value = int(part)
    if value < minimum:
        raise schedule_error(text, f"{what} must be an integer ≥ {minimum}, got {value}")
    return value


def _in_order(M: int) -> tuple[int, ...]:
    """b_n = n+1 (or a_n = n+1): every partial before the very next module."""
    return tuple(range(1, M + 1))


class Preset:
    """One schedule preset: `name` before the ':' of its string, `kind` in the parsed spec."""

    name: ClassVar[str]
    kind: ClassVar[str]
    forms: ClassVar[tuple[str, ...]]  # how its strings are written: what the accepted lists show
    takes_parameter: ClassVar[bool] = True
    layout_free: ClassVar[bool] = False  # a_n = b_n for every module whatever the model: no layout to optimise

    def parse(self, text: str, rest: str) -> dict[str, Any]:
        """The spec's fields from the text after `name:` (`text` is the whole string, for errors)."""
        return {}

    def format(self, spec: ScheduleSpec) -> str:
        return self.name

    def table(self, spec: ScheduleSpec, num_layers: int, devices: int, last_scale: LastScale) -> Schedule:
        raise NotImplementedError


class Tp(Preset):
    """a_n = b_n = n+1, s_n = 1: the dense model."""

    name = kind = "tp"
    forms = ("tp",)
    takes_parameter = False
    layout_free = True

    def table(self, spec: ScheduleSpec, num_layers: int, devices: int, last_scale: LastScale) -> Schedule:
        M = 2 * num_layers
        return Schedule(str(spec), devices, _in_order(M), (1.0,) * M, _in_order(M))


class Ladder(Preset):
    """a_n = b_n = min(n+2, M), s_n = 1 (Ladder Residual: every output enters one module late)."""

    name = kind = "ladder"
    forms = ("ladder",)
    takes_parameter = False
    layout_free = True

    def table(self, spec: ScheduleSpec, num_layers: int, devices: int, last_scale: LastScale) -> Schedule:
        M = 2 * num_layers
        late = tuple(min(n + 2, M) for n in range(M))
        return Schedule(str(spec), devices, late, (1.0,) * M, late)


class Dtp(Preset):
    """dtp:δ (the paper's eq. 2) and dtp:δ@K (the upper K layers converted, tp below)."""

    name = kind = "dtp"
    forms = ("dtp:δ", "dtp:δ@K")

    def parse(self, text: str, rest: str) -> dict[str, Any]:
        delta_part, at, upper_part = rest.partition("@")
        delta = _integer(text, delta_part, "δ", minimum=0)
        if not at:
            return {"delta": delta}
        upper = _integer(text, upper_part, "K (the converted upper layers)", minimum=1)
        if delta > upper:
            raise schedule_error(text, f"δ={delta} must be in 0 .. K={upper}")
        return {"delta": delta, "upper": upper}

    def format(self, spec: ScheduleSpec) -> str:
        return f"dtp:{spec.delta}" + (f"@{spec.upper}" if spec.upper is not None else "")

    def table(self, spec: ScheduleSpec, num_layers: int, devices: int, last_scale: LastScale) -> Schedule:
        name = str(spec)
        upper = num_layers if spec.upper is None else spec.upper
        if upper > num_layers:
            raise ScheduleError(f"schedule {name!r}: K={upper} converted layers, but the model has "
                                f"num_layers={num_layers}: K must be in 1 .. {num_layers}")
        if spec.delta > upper:
            where = f"num_layers={num_layers}" if spec.upper is None else f"K={upper}"
            raise ScheduleError(f"schedule {name!r}: δ={spec.delta} must be in 0 .. {where} (modules are "
                                f"counted two per layer)")
        return _dtp_table(name, devices, 2 * num_layers, 2 * upper, spec.delta, last_scale)


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
    return Schedule(name, devices, _in_order(M), tuple(scales), tuple(others), last_scale)


class Spd(Preset):
    """spd:B: at the layers B the attention's others arrive after the FFN (a_n = n+2); tp elsewhere.
    `spd:auto:K` / `spd:isolated:K` share the name and parse as `SpdAuto`."""

    name = kind = "spd"
    forms = ("spd:B (B a comma list of layers, e.g. spd:1,3,5)",)

    def parse(self, text: str, rest: str) -> dict[str, Any]:
        layers = [_integer(text, part, "each layer of B", minimum=0) for part in rest.split(",")]
        repeated = sorted({i for i in layers if layers.count(i) > 1})
        if repeated:
            raise schedule_error(text, f"layers {repeated} are given more than once")
        return {"layers": tuple(sorted(layers))}

    def format(self, spec: ScheduleSpec) -> str:
        return "spd:" + ",".join(map(str, spec.layers))

    def table(self, spec: ScheduleSpec, num_layers: int, devices: int, last_scale: LastScale) -> Schedule:
        beyond = [i for i in spec.layers if i >= num_layers]
        if beyond:
            raise ScheduleError(f"schedule {str(spec)!r}: layers {beyond} do not exist: the model's layers are "
                                f"0 .. {num_layers - 1}")
        M = 2 * num_layers
        dropped = [n + 1 for n in range(M)]
        for i in spec.layers:
            dropped[2 * i] = 2 * i + 2
        return Schedule(str(spec), devices, _in_order(M), (1.0,) * M, tuple(dropped))


class SpdAuto(Preset):
    """spd:auto:K (SPD's cumulative rule) and spd:isolated:K: K layers chosen on calibration data
    (`models.evaluation.spd_auto`), so there is no table until they are (`ScheduleSpec.with_spd_layers`)."""

    name, kind = "spd", "spd-auto"
    forms = ("spd:auto:K", "spd:isolated:K")

    def parse(self, text: str, rest: str) -> dict[str, Any]:
        head, colon, count = rest.partition(":")
        if head not in ("auto", "isolated") or not colon:
            raise schedule_error(text, f"expected spd:auto:K or spd:isolated:K, got spd:{rest}")
        return {"count": _integer(text, count, "K (layers to drop)", minimum=1),
                "rule": "cumulative" if head == "auto" else "isolated"}

    def format(self, spec: ScheduleSpec) -> str:
        return f"spd:{'auto' if spec.rule == 'cumulative' else 'isolated'}:{spec.count}"

    def table(self, spec: ScheduleSpec, num_layers: int, devices: int, last_scale: LastScale) -> Schedule:
        spec.check_depth(num_layers)
        raise ScheduleError(f"schedule {str(spec)!r} needs calibration data: its K layers are chosen by the KL "
                            f"each layer's dropped sync costs on the calibration blocks (SPD's sensitivity "
                            f"rule, models.evaluation.spd_auto: the affinity stage of optimise and of a job); "
                            f"resolve it there, or give the layers as spd:B")


class Pt(Preset):
    """pt:D: Parallel Track's sync pattern on this dense model, TP-sharded: the others' partials arrive at
    the end of each block of D layers (not Parallel Track's independent, narrower tracks)."""

    name = kind = "pt"
    forms = ("pt:D",)

    def parse(self, text: str, rest: str) -> dict[str, Any]:
        return {"block": _integer(text, rest, "D (layers per block)", minimum=1)}

    def format(self, spec: ScheduleSpec) -> str:
        return f"pt:{spec.block}"

    def table(self, spec: ScheduleSpec, num_layers: int, devices: int, last_scale: LastScale) -> Schedule:
        if spec.block > num_layers:
            raise ScheduleError(f"schedule {str(spec)!r}: D={spec.block} layers per block, but the model has "
                                f"num_layers={num_layers}: D must be in 1 .. {num_layers}")
        M, span = 2 * num_layers, 2 * spec.block
        others = tuple(min(span * (n // span + 1), M) for n in range(M))
        return Schedule(str(spec), devices, _in_order(M), (1.0,) * M, others)


_PRESETS: tuple[Preset, ...] = (Tp(), Dtp(), Ladder(), Spd(), SpdAuto(), Pt())
BY_KIND: dict[str, Preset] = {p.kind: p for p in _PRESETS}
BY_NAME: dict[str, Preset] = {p.name: p for p in _PRESETS if p.kind != "spd-auto"}  # spd:auto parses via its kind
_INTEGERS = "(δ, K, D non-negative integers: K, D ≥ 1)"


def accepted_forms(*, sep: str = ", ", auto: bool = True, without: Collection[str] = ()) -> str:
    """The presets' forms in the registry's order, joined by `sep`: the one list every error, help string
    and schema shows. `auto` False leaves out spd:auto:K and spd:isolated:K (only `optimise` and a job's
    affinity stage run the sensitivity pass that chooses their layers); `without`: kinds left out."""
    return sep.join(form for p in _PRESETS if p.kind not in without and (auto or p.kind != "spd-auto")
                    for form in p.forms)


LAYOUT_FREE: tuple[str, ...] = tuple(p.kind for p in _PRESETS if p.layout_free)  # an objective refuses these
ACCEPTED = f"{accepted_forms()} {_INTEGERS}"
ACCEPTED_WITHOUT_AUTO = f"{accepted_forms(auto=False)} {_INTEGERS}"  # a command that cannot choose spd:auto's layers

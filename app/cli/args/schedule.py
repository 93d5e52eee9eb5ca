"""`--schedule` on the command line: a dtp schedule and --delta agreeing, the schedule parsed before any
weights load, and the schedule whose objective `optimise`, `layout` and `score` optimise or score for.
Torch-free at import.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from app.cli.errors import CliError


class _GivenDelta(argparse._StoreAction):
    """--delta / -d that also records that it was given (`args.delta_given`)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        namespace.delta_given = True
        super().__call__(parser, namespace, values, option_string)


def schedule_flags(p: argparse.ArgumentParser) -> None:
    """Tell --delta given from its default (1), so that a dtp --schedule without --delta gives the layout its
    δ and one with a different --delta is refused (`schedule_of`)."""
    action = p._option_string_actions["--delta"]
    action.__class__ = _GivenDelta
    p.set_defaults(delta_given=False)


def schedule_text(args: argparse.Namespace, *, allow_auto: bool = False) -> str | None:
    """`--schedule S` canonical, None where it is the layout's dtp:δ (its shorthand) or not given.
    `allow_auto`: spd:auto:K passes (only `optimise` runs the sensitivity pass that chooses its layers)."""
    spec = schedule_of(args, allow_auto=allow_auto)
    return None if spec is None or str(spec) == f"dtp:{args.delta}" else str(spec)


def accepted_here(message: str, allow_auto: bool) -> str:
    """A schedule error's `accepted: …` list as the command accepts it: without spd:auto:K where the command
    cannot choose the layers."""
    from models.schedules.grammar import ACCEPTED, ACCEPTED_WITHOUT_AUTO

    return message if allow_auto else message.replace(ACCEPTED, ACCEPTED_WITHOUT_AUTO)


def schedule_of(args: argparse.Namespace, *, allow_auto: bool = False) -> Any:
    """`--schedule S` parsed (None: the layout's own dtp:δ), before any weights load. A dtp schedule sets
    args.delta to its δ (refused where --delta was given otherwise); for tp, ladder, spd and pt, --delta only
    names the layout's δ (recorded, not simulated)."""
    from models.schedules.grammar import ScheduleError, parse_schedule

    text = getattr(args, "schedule", None)
    if text is None:
        return None
    try:
        spec = parse_schedule(text)
    except ScheduleError as exc:  # it names what is accepted: here, what this command accepts
        raise CliError(f"--schedule: {accepted_here(str(exc), allow_auto)}") from exc
    if not spec.resolvable and not allow_auto:
        raise CliError(f"--schedule {spec}: spd:auto:K chooses its K layers by the sensitivity pass (the KL each "
                       f"layer's dropped attention sync costs on calibration data), which only `optimise` and a job's "
                       f"affinity stage run (report.json names the layers chosen); give the layers here as spd:B "
                       f"(e.g. spd:1,3)")
    if spec.kind == "dtp":
        if getattr(args, "delta_given", False) and args.delta != spec.delta:
            raise CliError(f"--delta {args.delta} and --schedule {spec} disagree (the schedule's δ is {spec.delta}): "
                           f"give one of them, or the same δ in both")
        args.delta = spec.delta
    return spec



def check_objective_schedule(config: Any, spec: Any) -> None:
    """The schedule `optimise` optimises for, checked against the model before any weights load."""
    from models.families import model_shape
    from models.schedules.grammar import parse_schedule

    layers = model_shape(config).num_layers
    if spec.chooses_spd_layers:
        count = parse_schedule(spec.schedule).count
        if count > layers:
            raise CliError(f"--schedule {spec.schedule}: K={count} layers to drop, but the model has "
                           f"num_layers={layers}: K must be in 1 .. {layers}")
        print(f"{spec.schedule}: choosing the {count} layers whose dropped attention sync costs least KL "
              f"on the calibration blocks, then optimising J_σ of that spd:B", file=sys.stderr)
        return
    try:
        schedule = spec.objective_schedule(layers)
    except ValueError as exc:  # ScheduleError / LayoutError: malformed, does not fit, nothing to optimise
        raise CliError(f"--schedule: {exc}") from exc
    if schedule is not None:
        print(f"optimising J_σ of schedule {schedule} (docs/schedules_objective.md)", file=sys.stderr)


def add_objective_schedule_flag(p: argparse.ArgumentParser, *, edges: bool) -> None:
    """--schedule for the commands that optimise or score layouts (and, for `optimise`, the further edges'
    storage). Skipped where the job spec already gives the command a --schedule flag."""
    if not any("--schedule" in action.option_strings for action in p._actions):
        p.add_argument("--schedule", metavar="S",
                       help="communication schedule whose objective J_σ the layouts are optimised for: dtp:δ | "
                            "dtp:δ@K | spd:B | spd:auto:K (optimise only) | pt:D (default: dtp:δ of --delta; "
                            "δ ≤ 1: the paper's objective); "
                            "tp and ladder are refused: the layout does not matter there (docs/cli.md)")
    if edges:
        p.add_argument("--edge-kept-mass", type=float, default=0.95,
                       help="mass a neuron→neuron edge keeps (its largest entries) when the dense edges exceed "
                            "--edge-memory-limit, as far as the limit allows (default: 0.95)")
        p.add_argument("--edge-memory-limit", type=int, default=1 << 30,
                       help="bytes the schedule's further edges may take dense before the neuron→neuron ones "
                            "are kept sparse; also bounds the pass's accumulators (more passes over the "
                            "blocks) (default: 1073741824)")


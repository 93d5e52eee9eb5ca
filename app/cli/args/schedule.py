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
    from models.schedules.grammar import shorthand

    return shorthand(schedule_of(args, allow_auto=allow_auto), args.delta)


def command_schedule(args: argparse.Namespace, *, allow_auto: bool = False) -> Any:
    """The one schedule the command runs (models.schedules.grammar.ScheduleSpec), from --schedule and --delta:
    the schedule given, else dtp:δ of --delta (`schedule_of` refuses a conflict and fills in --delta)."""
    from models.run.rules import job_schedule

    spec = schedule_of(args, allow_auto=allow_auto)
    return job_schedule(spec, args.delta)


def accepted_here(message: str, allow_auto: bool) -> str:
    """A schedule error's `accepted: …` list as the command accepts it: without spd:auto:K where the command
    cannot choose the layers."""
    from models.schedules.grammar import ACCEPTED, ACCEPTED_WITHOUT_AUTO

    return message if allow_auto else message.replace(ACCEPTED, ACCEPTED_WITHOUT_AUTO)


def schedule_of(args: argparse.Namespace, *, allow_auto: bool = False) -> Any:
    """`--schedule S` parsed (None: the layout's own dtp:δ), before any weights load. A dtp schedule sets
    args.delta to its δ (refused where --delta was given otherwise); for tp, ladder, spd and pt, --delta only
    names the layout's δ (recorded, not simulated)."""
    from models.run.rules import DeltaConflict, schedule_and_delta
    from models.schedules.grammar import ScheduleError

    text = getattr(args, "schedule", None)
    if text is None:
        return None
    try:
        spec, delta = schedule_and_delta(text, args.delta if getattr(args, "delta_given", False) else None)
    except DeltaConflict as exc:
        raise CliError(f"--delta {exc.delta} and --schedule {exc.schedule} disagree (the schedule's δ is "
                       f"{exc.schedule.delta}): give one of them, or the same δ in both") from exc
    except ScheduleError as exc:  # it names what is accepted: here, what this command accepts
        raise CliError(f"--schedule: {accepted_here(str(exc), allow_auto)}") from exc
    assert spec is not None
    if not spec.resolvable and not allow_auto:
        raise CliError(f"--schedule {spec}: spd:auto:K chooses its K layers by the sensitivity pass (the KL each "
                       f"layer's dropped attention sync costs on calibration data), which only `optimise` and a job's "
                       f"affinity stage run (report.json names the layers chosen); give the layers here as spd:B "
                       f"(e.g. spd:1,3)")
    if delta is not None:
        args.delta = delta
    return spec


def check_objective_schedule(config: Any, plan: Any) -> None:
    """The run `optimise` plans (models.run.plan.RunPlan) against the model, before any weights load: L, δ and the
    schedule it optimises for, by the rules its loading stage and the API's submit check apply
    (models.run.rules.model_refusals)."""
    from models.families import model_shape
    from models.run.rules import model_refusals

    shape = model_shape(config)
    for refusal in model_refusals(plan.facts, shape):
        if refusal.field == "schedule":
            raise CliError(f"--schedule: {refusal.message}")
        raise refusal.exception()
    if plan.schedule_pending:
        print(f"{plan.schedule}: choosing the {plan.schedule.count} layers whose dropped attention sync costs least "
              f"KL on the calibration blocks, then optimising J_σ of that spd:B", file=sys.stderr)
        return
    schedule = plan.optimise.objective_schedule(shape.num_layers)
    if schedule is not None:
        print(f"optimising J_σ of schedule {schedule} (docs/schedules_objective.md)", file=sys.stderr)


def add_objective_schedule_flag(p: argparse.ArgumentParser, *, edges: bool) -> None:
    """--schedule for the commands that optimise or score layouts (and, for `optimise`, the further edges'
    storage). Skipped where the job spec already gives the command a --schedule flag."""
    if not any("--schedule" in action.option_strings for action in p._actions):
        from models.schedules.presets import LAYOUT_FREE, accepted_forms

        p.add_argument("--schedule", metavar="S",
                       help=f"communication schedule whose objective J_σ the layouts are optimised for: "
                            f"{accepted_forms(sep=' | ', without=LAYOUT_FREE)} (spd:auto:K and spd:isolated:K: "
                            f"optimise only; default: dtp:δ of --delta; δ ≤ 1: the paper's objective); "
                            f"{' and '.join(LAYOUT_FREE)} are refused: the layout does not matter there (docs/cli.md)")
    if edges:
        p.add_argument("--edge-kept-mass", type=float, default=0.95,
                       help="mass a neuron→neuron edge keeps (its largest entries) when the dense edges exceed "
                            "--edge-memory-limit, as far as the limit allows (default: 0.95)")
        p.add_argument("--edge-memory-limit", type=int, default=1 << 30,
                       help="bytes the schedule's further edges may take dense before the neuron→neuron ones "
                            "are kept sparse; also bounds the pass's accumulators (more passes over the "
                            "blocks) (default: 1073741824)")


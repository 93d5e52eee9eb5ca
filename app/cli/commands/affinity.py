"""`dtp-layout layout` and `score`: the optimiser alone and the rescoring of layouts, on a saved affinity
file. Torch-free: a base install (no `worker` extra) runs both."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from app.cli.args.schedule import command_schedule
from app.cli.errors import CliError


def cmd_layout(args: argparse.Namespace) -> int:
    """The optimiser alone on a saved affinity; torch-free."""
    from models.affinity.file import AffinityResult
    from models.layouts.layout import Layout, check_delta, check_devices
    from models.optimise import optimise, upper_bound
    from models.variants.set import affinity_for, objective_schedule

    try:
        result = AffinityResult.load(args.affinity)
    except ValueError as exc:
        raise CliError(str(exc)) from exc
    check_devices(result.shape, args.devices)
    check_delta(result.shape, args.delta)
    try:
        schedule = objective_schedule(command_schedule(args), num_layers=result.shape.num_layers,
                                      devices=args.devices)
        sigma = None if schedule is None else result.schedule_affinity(args.score, schedule)
    except ValueError as exc:
        raise CliError(f"--schedule: {exc}") from exc
    affinity = affinity_for(result, args.score)
    layers = None
    if args.layers:
        try:
            layers = [int(x) for x in args.layers.split(",") if x.strip()]
        except ValueError as exc:
            raise CliError(f"--layers must be comma-separated integers, got {args.layers!r}") from exc
    options: dict[str, Any] = dict(maximise=not args.minimise, move_heads=not args.neurons_only,
                                   move_neurons=not args.heads_only, layers=layers, restarts=args.restarts)
    try:
        if sigma is not None:
            best: Any = optimise(sigma, args.devices, bound=upper_bound(sigma, args.devices), **options)
        else:
            best = optimise(affinity, args.devices, bound=upper_bound(affinity, args.devices), **options)
    except ValueError as exc:
        raise CliError(str(exc)) from exc
    layout = Layout(args.name, args.devices, args.delta, result.shape, best.kv_group_device, best.neuron_device,
                    score=best.report.as_dict(), schedule=None if schedule is None else str(schedule))
    layout.save(args.out)
    rep = best.report
    print(f"{args.name}: J={rep.J:.4f} (random {rep.random_expectation:.4f}, upper bound {rep.upper_bound:.4f}) "
          f"after {best.sweeps} sweeps → {args.out}")
    return 0


def cmd_score(args: argparse.Namespace) -> int:
    """J, J/bound and the per-layer co-located fractions of each layout; torch-free."""
    from models.schedules.grammar import parse_schedule
    from models.variants.score import rescore, score_table
    from models.variants.set import CHAIN

    try:
        schedule = CHAIN if args.schedule is None else parse_schedule(args.schedule)
    except ValueError as exc:
        raise CliError(f"--schedule: {exc}") from exc
    try:
        doc = rescore(args.affinity, args.layouts, score_name=args.score, schedule=schedule)
    except ValueError as exc:  # LayoutError and ScheduleError are ValueErrors
        raise CliError(str(exc)) from exc
    for warning in doc["warnings"]:
        print(f"warning: {warning}", file=sys.stderr)
    print(json.dumps(doc) if args.json else score_table(doc))
    return 0


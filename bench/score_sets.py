"""What the layout-score benches share (bench/repairable_damage.py, bench/lookahead_score.py): their `--set`
arguments ("WORK SCHEDULE RESULTS.json [experiment flags...]", a work directory whose layouts were trained and
the result file with their final KLs), the scoring text every set is scored on, and the loop that scores each
set and prints the separated pairs each score orders (`bench.objective_positions.pairs_ordered`)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

ScoreSet = Callable[[str, str, str, list[str], Any], dict[str, Any]]  # (work, schedule, results, flags, scoring)


def add_set_args(ap: argparse.ArgumentParser, set_help: str) -> None:
    ap.add_argument("--set", action="append", required=True, help=set_help)
    ap.add_argument("--score-source", default="corpus:kjv")
    ap.add_argument("--score-sequences", type=int, default=8, help="scoring blocks (0: each set's calibration)")
    ap.add_argument("--score-seq-len", type=int, default=1024)
    ap.add_argument("--out", type=Path, default=None)


def scoring_of(args: argparse.Namespace) -> Any:
    """The text every set is scored on (a `CalibrationSpec`); None: each set's own calibration."""
    from models.data.calibration import CalibrationSpec

    return CalibrationSpec(source=args.score_source, sequences=args.score_sequences,
                           seq_len=args.score_seq_len) if args.score_sequences else None


def score_sets(args: argparse.Namespace, score_set: ScoreSet, scoring: Any) -> list[dict[str, Any]]:
    """Every `--set` scored in turn, its pair counts printed as each finishes."""
    sets = []
    for spec_text in args.set:
        work, schedule, results, *extra = spec_text.split()
        row = score_set(work, schedule, results, extra, scoring)
        sets.append(row)
        print(f"{work} {schedule}: " + "; ".join(f"{p} {o}/{n}" + (f" (misorders {', '.join(bad)})" if bad else "")
                                                  for p, (o, n, bad) in row["ordered"].items()), flush=True)
    return sets

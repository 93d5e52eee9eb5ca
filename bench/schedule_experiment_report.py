"""docs/schedules.md from bench/schedule_experiment.py's finished runs (`--report PATH`): the verdict per
schedule under the rule fixed before the runs, each arm's KL per seed with its range, the curves, and how the
objectives rank the arms. Written from the work directory's result files alone (no model is loaded)."""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from bench.schedule_experiment import CONTIGUOUS, OPTIMISED, PREDICTORS, SPEEDUP, VERDICT_RULE, speedup_text
from bench.schedule_verdicts import slug, spread

ARM_ORDER = (OPTIMISED, "optimised-other", CONTIGUOUS)
PREDICTOR_NAMES = {"J_damage": "J_σ damage-weighted (the objective)", "J_unit": "J_σ unit-mass (issue 20's)",
                   "neg_missing_ffn_damage": "− missing FFN damage (the reviewer's measure)"}


def load_results(work: Path, schedules: list[str]) -> dict[str, dict[str, Any]]:
    """{schedule: its result-<σ>.json} for every schedule that has finished."""
    out = {}
    for schedule in schedules:
        path = work / f"result-{slug(schedule)}.json"
        if path.exists():
            out[schedule] = json.loads(path.read_text())
    return out


def arms_in_order(arms: Any) -> list[str]:
    return sorted(arms, key=lambda a: (ARM_ORDER.index(a) if a in ARM_ORDER else len(ARM_ORDER), a))


def gap_row(finals: dict[str, list[float]], arm: str) -> str:
    """The optimised arm's mean gap to `arm` and whether every seed separates them."""
    opt, other = finals[OPTIMISED], finals[arm]
    gap = statistics.fmean(other) - statistics.fmean(opt)
    if max(opt) < min(other):
        said = "separated (every optimised seed below every seed)"
    elif max(other) < min(opt):
        said = f"separated the other way (every {arm} seed below)"
    else:
        said = "within the seed spread"
    return f"{arm}'s mean KL minus optimised's {gap:+.3f} nats, {said}"


def step0_kl(curves: dict[str, dict[str, list[list[float]]]], arm: str) -> float:
    """KL at step 0 (before training, the same for every seed)."""
    return float(next(iter(curves[arm].values()))[0][1])


def verdict_line(row: dict[str, Any]) -> str:
    v = row["verdict"]
    if v is None:
        return "no verdict (an arm is missing)"
    reach = ("never" if v["optimised_reaches_at"] == float("inf") else f"step {v['optimised_reaches_at']:.0f}")
    contiguous = ("never" if v["contiguous_reaches_at"] == float("inf")
                  else f"step {v['contiguous_reaches_at']:.0f}")
    return (f"**{v['verdict']}** — every optimised seed below every baseline seed: "
            f"{'yes' if v['below_every_baseline_seed'] else 'no'}; contiguous's final mean KL {v['target_kl']:.3f} "
            f"reached by every optimised seed at {reach}, by contiguous's mean curve at {contiguous} "
            f"(speedup {speedup_text(v['speedup'])}, the rule needs {SPEEDUP}×)")


def schedule_section(schedule: str, row: dict[str, Any]) -> list[str]:
    curves, finals, second = row["curves"], row["final_kl"], row["final_kl_second_domain"]
    arms = arms_in_order(finals)
    resolved = row["resolved"] if row["resolved"] != schedule else ""
    amended = row.get("amended_verdict")  # results from before issue 45 have none
    lines = [f"### {schedule}" + (f" = `{resolved}`" if resolved else ""), "",
             "Verdict: " + verdict_line(row), "",
             *([f"Amended rule (issue 45): **{amended['verdict']}** ({amended['why']})", ""] if amended else [])]
    lines += ["| layout | J_σ damage | J_σ unit | KL @0 | final KL, primary (mean, range) | per seed | "
              "final KL, second domain (mean, range) |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for arm in arms:
        seeds = " / ".join(f"{k:.3f}" for k in finals[arm])
        lines.append(f"| {arm} | {row['predictors']['J_damage'][arm]:.3f} | {row['predictors']['J_unit'][arm]:.3f} | "
                     f"{step0_kl(curves, arm):.3f} | {spread(finals[arm])} | {seeds} | {spread(second[arm])} |")
    lines.append("")
    for arm in arms:
        if arm != OPTIMISED and OPTIMISED in finals:
            lines.append(f"- Primary: {gap_row(finals, arm)}; second domain: {gap_row(second, arm)}.")
    ranks = row["ranking"]
    lines.append("- Objectives against the trained order (pairs of arms separated beyond the seed spread): "
                 + "; ".join(f"{PREDICTOR_NAMES[p]} {sum(r['agrees'] for r in ranks[p])} of {len(ranks[p])}"
                             for p in PREDICTORS) + ".")
    steps = sorted({s for by_seed in curves.values() for c in by_seed.values() for s, _ in c})
    lines += ["", "| mean KL (primary) at step | " + " | ".join(map(str, steps)) + " |",
              "| --- | " + " | ".join("---" for _ in steps) + " |"]
    for arm in arms:
        per_step = {s: [dict(map(tuple, c))[s] for c in curves[arm].values() if s in dict(map(tuple, c))]
                    for s in steps}
        lines.append(f"| {arm} | " + " | ".join(f"{statistics.fmean(v):.3f}" if v else "–"
                                                for v in per_step.values()) + " |")
    return [*lines, ""]


def summary_table(results: dict[str, dict[str, Any]]) -> list[str]:
    lines = ["| schedule | verdict | optimised, final KL (range) | contiguous | random | speedup to contiguous's "
             "final |",
             "| --- | --- | --- | --- | --- | --- |"]
    for schedule, row in results.items():
        finals = row["final_kl"]
        rand = next((a for a in finals if a.startswith("random")), None)
        v = row["verdict"] or {"verdict": "–", "speedup": float("nan")}
        lines.append(f"| {schedule} | {v['verdict']} | {spread(finals.get(OPTIMISED, [float('nan')]))} | "
                     f"{spread(finals.get(CONTIGUOUS, [float('nan')]))} | "
                     f"{spread(finals[rand]) if rand else '–'} | {speedup_text(v['speedup'])} |")
    return lines


def render(results: dict[str, dict[str, Any]], args: argparse.Namespace, *, command: str, notes: str = "") -> str:
    """The page: setup, the rule, the summary, a section per schedule, then `notes` (hand-written reading)."""
    seeds = args.seeds.replace(",", ", ")
    missing = [s for s in args.schedules.split() if s not in results]
    lines = [
        f"# Communication schedules on SmolLM2-135M, L={args.devices}: does the schedule's own layout train better?",
        "",
        "Generated by `bench/schedule_experiment.py --report docs/schedules.md` from the experiment's work "
        "directory (issue 29's decisive experiment). The runs:",
        "", "```sh", command, "```", "",
        f"Setup, the same for every arm: affinity on {args.calib_sequences} × {args.calib_seq_len} tokens of "
        f"`{args.calib}` (where held-out J converged, [method.md](method.md#how-much-calibration-text)); the "
        f"optimiser maximises the schedule's damage-weighted J_σ ({args.restarts} restarts); three layouts per "
        f"schedule — optimised for it, contiguous (storage order, i.e. plain tensor-parallel sharding), one random "
        f"(seed 1000) — each distilled under the schedule with training seeds {seeds} (the seed orders the "
        f"training batches; the same seeds for every arm): {args.steps} steps of {args.batch_size} × "
        f"{args.seq_len} tokens of `{args.train}`, lr {args.lr} ({max(1, args.steps // 10)} warm-up steps, cosine "
        f"to {args.lr / 10:g}), AdamW, KL(dense ‖ student) + 0.1·CE, embeddings frozen. KL in nats per token on "
        f"{args.eval_blocks} × {args.seq_len} = {args.eval_blocks * args.seq_len:,} held-out tokens of "
        f"`{args.eval}` every {args.eval_every} steps (primary) and on {args.eval2_blocks} × {args.seq_len} = "
        f"{args.eval2_blocks * args.seq_len:,} tokens of `{args.eval2}` (second domain) after the last step.",
        "",
        f"**The verdict rule, fixed before the runs and printed by the script:** {VERDICT_RULE}. "
        "Ranges are min–max over the three seeds; a difference is called a result only where every seed of one "
        "arm is below every seed of the other.",
        "",
        "## Verdicts", "",
        *summary_table(results), "",
    ]
    if missing:
        lines += [f"Not run yet: {', '.join(missing)}.", ""]
    lines += ["## Each schedule", ""]
    for schedule, row in results.items():
        lines += schedule_section(schedule, row)
    if notes:
        lines += [notes.rstrip(), ""]
    return "\n".join(lines)


READING_MARK = "<!-- the reading below is written by hand from the tables above; --report keeps it -->"


def write_report(args: argparse.Namespace, path: Path, *, command: str) -> str:
    """Rewrite `path` from the results, keeping its hand-written reading (everything from READING_MARK on)."""
    results = load_results(args.work, args.schedules.split())
    old = path.read_text() if path.exists() else ""
    notes = old[old.index(READING_MARK):] if READING_MARK in old else READING_MARK + "\n"
    text = render(results, args, command=command, notes=notes)
    path.write_text(text)
    return text

"""Issue 45 item 4's decision: at dtp:2, does the layout a short training probe picks train better than the
layout J_σ picks? The rule and the setup are fixed here, committed before any run of this bench.

Why: at δ ≥ 2 the schedule objective J_σ does not rank layouts as they train (docs/schedules.md: it misorders
the dtp:1-optimised layout trained under dtp:2; no untrained score tried ranks it). The product's probe
(`optimise --probe K`, docs/cli.md) trains K candidate layouts for S steps on calibration text and keeps the one
with the lowest held-out KL. Whether that pick is better *after real training* is what this bench decides.

THE SETUP (fixed): SmolLM2-135M (the packaged GGUF), L = 3, schedule dtp:2; calibration corpus:kjv, 8 blocks of
1024 tokens (bench/schedule_experiment.py's default, where held-out J converged); the probe as the product runs
it with K = 4 candidates (the dtp:2-optimised layout, the dtp:1-optimised layout, the 50/50 mixture of their
objectives, one optimiser restart with another seed), S = 20 steps of 4 × 64 tokens on the calibration text,
held-out KL on 16 × 64 tokens of the calibration text after the blocks it trained on. Then two arms, each
distilled under dtp:2 with seeds 0, 1, 2 for 100 steps of 4 × 64 tokens of corpus:kjv (after the calibration
blocks), lr 1e-4, evaluated every 10 steps on 64 × 64 held-out tokens of corpus:kjv (the primary domain) and,
after the last step, on 64 × 64 tokens of corpus:shakespeare (the second domain):

    jsigma-pick   the layout J_σ of dtp:2 picks (the job's `optimised`)
    probe-pick    the candidate the probe picks

THE RULE (PROBE_RULE, fixed before any run):

- "same pick" where the probe picks J_σ's layout (the same layout up to a relabelling of the devices): at this
  budget the probe changes nothing, and there is nothing to train;
- "probe better" only if, on BOTH domains, every probe-pick run (one per seed) ends below every jsigma-pick run
  (final KL), and the runs' mean final KL on the primary domain is at least MIN_GAP = 0.01 nats lower (the
  paper reads differences under 0.01 KL as ties);
- "J_σ better" under the same conditions with the arms exchanged;
- otherwise "not shown at this budget".

Exactly 3 seeds per arm on both domains are required; with fewer the verdict is "not decided".
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROBE_RULE = ('"same pick" where the probe picks J_sigma\'s layout (up to a relabelling of the devices); "probe '
              'better" only if on both domains every probe-pick run (seed) ends below every jsigma-pick run and the '
              "mean final KL on the primary domain is at least 0.01 nats lower; \"J_sigma better\" likewise with the "
              'arms exchanged; "not decided" with fewer than 3 seeds per arm on either domain; otherwise "not shown '
              'at this budget"')
MIN_GAP = 0.01  # nats: the paper reads differences below 0.01 KL as ties
SEEDS = 3
JSIGMA, PROBE = "jsigma-pick", "probe-pick"
SAME, PROBE_BETTER, JSIGMA_BETTER = "same pick", "probe better", "J_sigma better"
NOT_SHOWN, NOT_DECIDED = "not shown at this budget", "not decided"


@dataclass(frozen=True)
class ArmFinals:
    """One arm's final KL per seed on each domain: {seed: kl}."""

    primary: dict[int, float]
    second: dict[int, float]


def _beats(better: ArmFinals, worse: ArmFinals) -> bool:
    """Every run of `better` below every run of `worse` on both domains, and the primary means MIN_GAP apart."""
    separated = all(max(better_d.values()) < min(worse_d.values())
                    for better_d, worse_d in ((better.primary, worse.primary), (better.second, worse.second)))
    gap = statistics.fmean(worse.primary.values()) - statistics.fmean(better.primary.values())
    return separated and gap >= MIN_GAP


def probe_decision(*, same_layout: bool, jsigma: ArmFinals | None, probe: ArmFinals | None) -> dict[str, Any]:
    """PROBE_RULE on the two arms' final KLs (None: the arm was not trained, as under "same pick")."""
    if same_layout:
        return {"verdict": SAME, "why": "the probe picked J_sigma's layout: nothing to compare at this budget"}
    if jsigma is None or probe is None:
        return {"verdict": NOT_DECIDED, "why": "an arm was not trained"}
    short = [f"{name} {domain}" for name, arm in ((JSIGMA, jsigma), (PROBE, probe))
             for domain, finals in (("primary", arm.primary), ("second", arm.second)) if len(finals) < SEEDS]
    if short:
        return {"verdict": NOT_DECIDED, "why": f"fewer than {SEEDS} seeds: {', '.join(short)}"}
    gap = statistics.fmean(jsigma.primary.values()) - statistics.fmean(probe.primary.values())
    said = {"mean_gap_primary": gap}  # > 0: the probe's pick ends lower
    if _beats(probe, jsigma):
        return {**said, "verdict": PROBE_BETTER, "why": f"every probe-pick run below every jsigma-pick run on both "
                                                       f"domains, the primary means {gap:.3f} apart"}
    if _beats(jsigma, probe):
        return {**said, "verdict": JSIGMA_BETTER, "why": f"every jsigma-pick run below every probe-pick run on both "
                                                        f"domains, the primary means {-gap:.3f} apart"}
    return {**said, "verdict": NOT_SHOWN, "why": "the arms' runs overlap on a domain, or the primary means are "
                                                 f"under {MIN_GAP} apart ({gap:+.3f})"}


# ---- the run (committed after the rule above) ---------------------------------------------------------------------
#
#     .venv/bin/python -m bench.probe_decision            # the decision: hours of CPU (not yet run)
#     .venv/bin/python -m bench.probe_decision --quick    # a smoke run of every step: not the decision

PROBE_CANDIDATES, PROBE_STEPS, PROBE_EVAL_BLOCKS, PROBE_SEQ_LEN = 4, 20, 16, 64
SCHEDULE = "dtp:2"
# The decision's fixed setup, against which a run says whether its verdict is the decision or a smoke run.
DECISION = {"preset": "cpu-long", "seeds": "0,1,2", "steps": 100, "probe": PROBE_CANDIDATES,
            "probe_steps": PROBE_STEPS, "layers": None, "model": None}


def parse_args(argv: list[str]) -> Any:
    """bench/schedule_experiment.py's flags (the cpu-long preset: 100 steps of 4 × 64, evaluations every 10 on
    64 × 64 tokens of both domains) plus the probe's; --quick is its smoke preset and a probe of 2 × 2 steps."""
    import argparse

    from bench.schedule_experiment import REPO
    from bench.schedule_experiment import parse_args as experiment_args

    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--probe", type=int, default=None)
    ap.add_argument("--probe-steps", type=int, default=None)
    ap.add_argument("--probe-eval-blocks", type=int, default=None)
    own, rest = ap.parse_known_args(argv)
    quick = "--quick" in rest
    given = {a.split("=")[0] for a in rest}
    base = [] if quick or "--preset" in given else ["--preset", "cpu-long"]
    work = [] if "--work" in given else ["--work", str(REPO / "var" / ("probe-decision" + ("-quick" if quick else "")))]
    args = experiment_args([*base, *work, "--schedules", SCHEDULE, "--optimised-layouts", "1", "--random-layouts",
                            "0", *rest])
    args.probe = own.probe or (2 if quick else PROBE_CANDIDATES)
    args.probe_steps = own.probe_steps or (2 if quick else PROBE_STEPS)
    args.probe_eval_blocks = own.probe_eval_blocks or (2 if quick else PROBE_EVAL_BLOCKS)
    # the calibration's tokens in blocks of 64, at least one probe batch of them (--quick's 64 tokens: 4 × 16)
    args.probe_seq_len = min(PROBE_SEQ_LEN, args.calib_sequences * args.calib_seq_len // 4)
    return args


def is_decision(args: Any) -> bool:
    """Whether this run is the committed setup (anything else is a smoke run, whatever its verdict says)."""
    return all(getattr(args, key) == value for key, value in DECISION.items())


def pick(args: Any, experiment: Any) -> tuple[dict[str, Any], Path]:
    """The probe as the product runs it (models.probe) on the experiment's dtp:2 affinity; the two arms' layouts
    written where the experiment trains them: optimised.json (J_σ's pick) and, unless the same, probe-pick.json."""
    from models.data.calibration import CalibrationSpec
    from models.probe.candidates import probe_candidates
    from models.probe.probe import run_probe
    from models.probe.spec import ProbeSpec
    from models.schedules.grammar import parse_schedule
    from models.variants.set import build_layouts, neuron_agreement

    sched, result = experiment.schedule(SCHEDULE), experiment.affinity(SCHEDULE)
    out = args.work / "layouts" / SCHEDULE.replace(":", "-")
    if not (out / "optimised.json").exists():
        optimised = build_layouts(result, devices=args.devices, delta=1, restarts=args.restarts,
                                  schedule=sched)["optimised"]
        candidates = probe_candidates(result, count=args.probe, devices=args.devices, delta=1, score_name="fo",
                                      schedule=sched, restarts=args.restarts, optimised=optimised)
        # the calibration's first tokens, in blocks of the probe's length: the text the affinity pass read
        tokens = args.calib_sequences * args.calib_seq_len
        calibration = CalibrationSpec(args.calib, sequences=tokens // args.probe_seq_len, seq_len=args.probe_seq_len)
        record = run_probe(ProbeSpec(candidates=args.probe, steps=args.probe_steps,
                                     eval_sequences=args.probe_eval_blocks, max_seconds=7 * 86_400),
                           teacher=experiment.model, tokenizer=experiment.tokenizer, candidates=candidates,
                           calibration=calibration, schedule=parse_schedule(SCHEDULE), out_dir=args.work / "probe",
                           announce=lambda line: print(f"probe: {line}", flush=True))
        optimised.save(out / "optimised.json")
        chosen = candidates[record["chosen"]]
        same = neuron_agreement(chosen, optimised)
        if not (same["neurons"] == 1.0 and same["kv_groups"] == 1.0):
            chosen.with_name(PROBE).save(out / f"{PROBE}.json")
    record = json.loads((args.work / "probe" / "probe.json").read_text())
    same_layout = not (out / f"{PROBE}.json").exists()
    return {**record, "same_layout": same_layout}, out


def finals(curves: dict[str, dict[int, list[tuple[int, float]]]], second: dict[str, list[float]],
           arm: str) -> ArmFinals | None:
    if arm not in curves:
        return None
    seeds = sorted(curves[arm])
    return ArmFinals(primary={s: curves[arm][s][-1][1] for s in seeds},
                     second=dict(zip(seeds, second.get(arm, []), strict=False)))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import sys

    from bench.schedule_experiment_runs import Experiment

    args = parse_args(sys.argv[1:] if argv is None else argv)
    print(f"rule (fixed before any run): {PROBE_RULE}", flush=True)
    decision = is_decision(args)  # read before the experiment resolves the default model to its path
    experiment = Experiment(args)
    probe, _ = pick(args, experiment)
    print(f"probe picked {probe['chosen']} (J_sigma's pick: optimised)", flush=True)
    curves, second = ({}, {}) if probe["same_layout"] else experiment.train(SCHEDULE)
    jsigma, probed = finals(curves, second, "optimised"), finals(curves, second, PROBE)
    said = probe_decision(same_layout=probe["same_layout"], jsigma=jsigma, probe=probed)
    result = {"rule": PROBE_RULE, "decision": decision, "verdict": said, "probe": probe,
              "final_kl": {JSIGMA: None if jsigma is None else jsigma.primary,
                           PROBE: None if probed is None else probed.primary},
              "final_kl_second_domain": {JSIGMA: None if jsigma is None else jsigma.second,
                                         PROBE: None if probed is None else probed.second},
              "setup": {k: str(getattr(args, k)) for k in ("preset", "steps", "seeds", "devices", "calib", "train",
                                                          "eval", "eval2", "probe", "probe_steps", "model", "layers")}}
    (args.work / "probe-decision.json").write_text(json.dumps(result, indent=1, default=str))
    kind = "the decision" if decision else "a smoke run, not the decision"
    print(f"{SCHEDULE}: {said['verdict']} ({said['why']}) [{kind}]; {args.work / 'probe-decision.json'}", flush=True)
    return result


if __name__ == "__main__":
    main()

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

import statistics
from dataclasses import dataclass
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

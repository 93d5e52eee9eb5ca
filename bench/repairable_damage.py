"""Issue 29: does the damage that training cannot absorb rank layouts as they train where J_σ does not?

The scores tried so far (J_σ, the missing FFN damage, the joint damage of bench/joint_damage.py) measure how
large a layout's damage is in the untrained DTP model. The recorded runs say that is not what decides the
trained order: under dtp:2 on SmolLM2-135M the untrained model's own KL puts random (7.82) behind the dtp:1
layout (7.29), yet random trains to 1.55–1.59 and the dtp:1 layout to 2.00–2.03 (docs/schedules.md). The
question here is *which part* of the damage distillation repairs.

The hypothesis, from the units' side: module t's units on device d read their device's normed stream
n_d = RMSNorm(x + dev_{t,d}) through their own rows (W^qkv_g, w^g_k, w^u_k), which no other device reads.
Whatever part of the missing input p_{t,d} = γ_t ⊙ dev_{t,d} / r_t is a *linear function of n_d*, those rows
can absorb: w ← w + Qᵀw makes the unit read n_d + n_d Q ≈ n_d + p. So the repairable part is the least-squares
prediction of p from n_d (one Q per module and device, shared by every token), and the damage that remains is
the joint damage of the residual

    p̃_{t,d} = p_{t,d} − n_d Q_{t,d},   Q_{t,d} = (N_dᵀN_d + λI)⁻¹ N_dᵀ P_{t,d}   (ridge, λ = 1e-3 · tr(NᵀN)/D)

fitted on one half of the scoring blocks and applied to the other (two folds, even and odd blocks), so a fit
of D = 576 regressors cannot explain noise. The receiving units' first-order damage of p̃ is then
bench/joint_damage.py's, unchanged. A score for ranking layouts (lower: better), not an objective.

Rule fixed before its first run (2026-12-05, committed with this script): the repairable-damage score
("unabsorbed FFN damage", the FFNs' damage of p̃) "ranks the other-schedule layout" only if it orders every
separated pair (every seed of one arm below every seed of the other) of both dtp:2 four-arm sets (the
30-layer and the 2-layer); otherwise it is rejected. Both sets are scored on the same 8 × 1,024 tokens of
`corpus:kjv` (the 30-layer set's calibration text; the 2-layer set calibrated on 4 × 128 of them).

    OMP_NUM_THREADS=1 .venv/bin/python bench/repairable_damage.py --set "var/jd dtp:2 RESULTS.json --other dtp:1"
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

RULE = ("the unabsorbed FFN damage ranks the other-schedule layout only if it orders every separated pair of both "
        "dtp:2 four-arm sets (30-layer and 2-layer), scored on the same 8 x 1,024 corpus:kjv tokens; otherwise "
        "it is rejected")
RIDGE = 1e-3  # λ as a fraction of the mean eigenvalue of NᵀN: keeps a fold's solve well posed, fits nothing


class LinearRepair:
    """The two passes over the same blocks: `collect` sums each (module, device, fold)'s NᵀN and NᵀP, `fit`
    solves the ridge Q of every fold, `residual` returns p − n Q with Q fitted on the *other* fold."""

    def __init__(self, folds: int = 2, ridge: float = RIDGE) -> None:
        self.folds, self.ridge = folds, ridge
        self.gram: dict[tuple[int, int, int], torch.Tensor] = {}  # (n, d, fold) → NᵀN [D, D]
        self.cross: dict[tuple[int, int, int], torch.Tensor] = {}  # (n, d, fold) → NᵀP [D, D]
        self.q: dict[tuple[int, int, int], torch.Tensor] = {}  # (n, d, fold) → Q fitted without that fold
        self.kept: dict[str, float] = {"p": 0.0, "residual": 0.0}  # Σ‖p‖², Σ‖p̃‖²: the unabsorbed share

    def collect(self, n: int, d: int, b: int, p: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
        key = (n, d, b % self.folds)
        g, c = seen.t() @ seen, seen.t() @ p  # [D, D] each
        self.gram[key] = self.gram[key] + g if key in self.gram else g
        self.cross[key] = self.cross[key] + c if key in self.cross else c
        return p

    def fit(self) -> None:
        for n, d, fold in self.gram:
            others = [(n, d, f) for f in range(self.folds) if f != fold and (n, d, f) in self.gram]
            gram = sum(self.gram[k] for k in others)
            cross = sum(self.cross[k] for k in others)
            if not isinstance(gram, torch.Tensor) or not isinstance(cross, torch.Tensor):
                raise ValueError(f"blocks in one fold only: nothing held out to fit module {n}, device {d} on "
                                 f"(score at least {self.folds} blocks)")
            size = gram.shape[0]
            lam = self.ridge * float(gram.diagonal().sum()) / size + 1e-300  # > 0 even for an all-zero input
            self.q[(n, d, fold)] = torch.linalg.solve(gram + lam * torch.eye(size, dtype=gram.dtype), cross)
        self.gram.clear()
        self.cross.clear()

    def residual(self, n: int, d: int, b: int, p: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
        out = p - seen @ self.q[(n, d, b % self.folds)]  # [T, D]
        self.kept["p"] += float(p.square().sum())
        self.kept["residual"] += float(out.square().sum())
        return out


def unabsorbed_damage(model: Any, blocks: torch.Tensor, schedule: Any, heads: Any, cells: Any,
                      repair: LinearRepair | None = None) -> dict[str, Any]:
    """{"joint": joint_damage's row, "unabsorbed": the same of the residual, "kept": Σ‖p̃‖² / Σ‖p‖²}."""
    from bench.joint_damage import joint_damage

    repair = repair or LinearRepair()
    joint = joint_damage(model, blocks, schedule, heads, cells, deviation=repair.collect)
    repair.fit()
    unabsorbed = joint_damage(model, blocks, schedule, heads, cells, deviation=repair.residual)
    return {"joint": joint, "unabsorbed": unabsorbed, "kept": repair.kept["residual"] / max(repair.kept["p"], 1e-300)}


def score_set(work: str, schedule: str, results: str, extra: list[str], scoring: Any | None) -> dict[str, Any]:
    """Every arm of WORK's σ layouts scored on `scoring` (a `CalibrationSpec`; None: the set's calibration)."""
    from bench.objective_positions import pairs_ordered
    from bench.schedule_experiment import RECORDED_SETS
    from bench.schedule_experiment import parse_args as experiment_args
    from bench.schedule_experiment_runs import Experiment
    from models.data.calibration import load_blocks
    from models.layouts import layout as layout_mod

    experiment = Experiment(experiment_args(["--work", work, "--schedules", schedule, *RECORDED_SETS, *extra]))
    sched = experiment.schedule(schedule)
    blocks = experiment.blocks() if scoring is None else load_blocks(
        scoring, experiment.tokenizer, vocab_size=int(experiment.model.config.vocab_size))
    predicted = experiment.predictors(schedule)
    rows: dict[str, dict[str, Any]] = {}
    for arm in experiment.arms(schedule):
        lay = layout_mod.load(experiment.layouts(schedule) / f"{arm}.json")
        t0 = time.perf_counter()
        got = unabsorbed_damage(experiment.model, blocks, sched, lay.kv_group_device, lay.neuron_device)
        rows[arm] = {"joint_ffn": got["joint"]["ffn"], "joint_attention": got["joint"]["attention"],
                     "unabsorbed_ffn": got["unabsorbed"]["ffn"], "unabsorbed_attention": got["unabsorbed"]["attention"],
                     "unabsorbed_per_module": got["unabsorbed"]["per_module"], "kept": got["kept"],
                     "seconds": time.perf_counter() - t0}
        print(f"{work} {schedule} {arm}: J_damage {predicted['J_damage'][arm]:.3f} joint_ffn "
              f"{rows[arm]['joint_ffn']:.4g} unabsorbed_ffn {rows[arm]['unabsorbed_ffn']:.4g} unabsorbed_attention "
              f"{rows[arm]['unabsorbed_attention']:.4g} (‖p̃‖²/‖p‖² {got['kept']:.3f}, {rows[arm]['seconds']:.0f} s)",
              flush=True)
    finals = json.loads(Path(results).read_text())["final_kl"]
    finals = {arm: kls for arm, kls in finals.items() if arm in rows}
    scores = {"J_damage": predicted["J_damage"],
              **{name: {arm: -row[name] for arm, row in rows.items()}  # lower damage: better
                 for name in ("joint_ffn", "unabsorbed_ffn", "unabsorbed_attention")}}
    return {"work": work, "schedule": schedule, "results": results, "arms": rows, "final_kl": finals,
            "ordered": {name: pairs_ordered(values, finals) for name, values in scores.items()}}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from bench.score_sets import add_set_args, score_sets, scoring_of

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_set_args(ap, '"WORK SCHEDULE RESULTS.json [experiment flags...]": a work directory whose layouts were '
                     "trained, and the result file with their final KLs")
    args = ap.parse_args(argv)
    print(f"rule (fixed before the first run): {RULE}", flush=True)
    scoring = scoring_of(args)
    sets = score_sets(args, score_set, scoring)
    out = {"rule": RULE, "ridge": RIDGE, "scoring": None if scoring is None else str(scoring), "sets": sets}
    if args.out is not None:
        args.out.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()

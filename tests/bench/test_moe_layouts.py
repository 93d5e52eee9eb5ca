"""bench/moe_layouts.py: the evidence bench runs the setup its rule fixed, and its verdict is recomputed from a runs
file alone (the model and the training are bench/schedule_experiment.py's, tested there)."""

from __future__ import annotations

import json

from bench import moe_layouts as ml
from bench import schedule_verdicts as sv
from bench.schedule_experiment import parse_args

STEPS = (0, 10, 20)


def test_the_bench_runs_the_fixed_setup(tmp_path):
    args = ml.parse_args(["--work", str(tmp_path)])
    run = parse_args(ml.experiment_argv(args, tmp_path / "model"))
    assert (run.schedules, run.devices, run.seeds) == ("dtp:1", 3, "0,1,2")
    assert (run.optimised_layouts, run.random_layouts, run.preset) == (2, 2, "cpu")
    assert (run.steps, run.batch_size, run.seq_len, run.eval_every, run.lr) == (50, 4, 64, 10, 1e-4)
    assert run.model == str(tmp_path / "model") and run.runs_dir == tmp_path / "runs"


def test_the_smoke_run_keeps_every_arm_the_rule_reads(tmp_path):
    args = ml.parse_args(["--quick", "--work", str(tmp_path)])
    run = parse_args(ml.experiment_argv(args, tmp_path / "model"))
    assert (run.optimised_layouts, run.random_layouts) == (2, 2) and run.restarts >= 1
    assert run.steps == 2 and run.seeds == "0,1" and run.schedules == "dtp:1"


def curve(kls: tuple[float, ...]) -> tuple[tuple[int, float], ...]:
    return tuple(zip(STEPS, kls, strict=True))


def test_the_verdict_is_recomputed_from_the_runs_file(tmp_path, capsys):
    # contiguous's mean final KL is 1.0, first reached at step 20; each optimised run reaches it between steps 0
    # and 10 at 0 + (2.0 − 1.0) / (2.0 − 0.9) · 10 = 9.09 → 20 / 9.09 = 2.2×, and ends below every other run
    runs = [sv.Run("contiguous", "contiguous", s, curve((3.0, 2.0, 1.0))) for s in (0, 1)]
    runs += [sv.Run("random", f"random-{k}", 0, curve((3.5, 2.2, 1.2))) for k in (1000, 1001)]
    runs += [sv.Run("optimised", name, 0, curve((2.0, 0.9, 0.8))) for name in ("optimised", "optimised-seed1")]
    path = tmp_path / "dtp-1-20steps.json"
    sv.write_runs(path, "dtp:1", 20, runs, source="test")
    said = ml.main(["verdict", str(path)])
    assert said["verdict"] == sv.HELPS and abs(said["speedup"] - 20 / (10 / 1.1)) < 1e-9
    assert json.loads(capsys.readouterr().out)["verdict"] == sv.HELPS


def test_one_optimised_layout_is_not_decided(tmp_path):
    runs = [sv.Run("contiguous", "contiguous", 0, curve((3.0, 2.0, 1.0))),
            sv.Run("random", "random-1000", 0, curve((3.5, 2.2, 1.2))),
            sv.Run("random", "random-1001", 0, curve((3.5, 2.2, 1.2))),
            sv.Run("optimised", "optimised", 0, curve((2.0, 0.9, 0.8)))]
    assert ml.verdict(runs)["verdict"] == sv.NOT_DECIDED


def test_the_rule_is_the_schedule_experiments_amended_rule():
    assert ml.RULE == sv.AMENDED_RULE

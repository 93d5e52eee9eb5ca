"""bench/schedule_experiment.py: its fixed rules on hand-made curves, and a smoke run on a tiny model.

The rules are written here from the issue's wording: a ranking pair counts only where every seed of one
arm ends below every seed of the other; "helps" needs the optimised arm below every baseline seed and at
contiguous's final KL at least 1.5× sooner.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os

import numpy as np
import pytest
import torch

from bench import schedule_experiment as exp
from models.affinity.file import AffinityResult
from models.layouts import layout as layout_file
from models.run.files import AFFINITY_FILE
from models.schedules.grammar import resolve_schedule
from models.variants.set import score_both
from tests.tiny import tiny_model


def curves(*finals_by_arm: tuple[str, list[list[tuple[int, float]]]]) -> dict:
    return {arm: dict(enumerate(per_seed)) for arm, per_seed in finals_by_arm}


def test_ranking_compares_only_arms_separated_beyond_the_seed_spread():
    finals = {"optimised": [1.0, 1.1, 1.2], "contiguous": [1.3, 1.5, 1.4], "random-1000": [1.25, 1.6, 1.35]}
    agrees = exp.ranking({"optimised": 3.0, "contiguous": 2.0, "random-1000": 2.5}, finals)
    # optimised beats both; contiguous vs random overlap (1.3..1.5 vs 1.25..1.6): not compared
    assert [(r["better"], r["worse"]) for r in agrees] == [("optimised", "contiguous"), ("optimised", "random-1000")]
    assert all(r["agrees"] for r in agrees)
    flipped = exp.ranking({"optimised": 1.0, "contiguous": 2.0, "random-1000": 0.5}, finals)
    assert [r["agrees"] for r in flipped] == [False, True]


def test_the_verdict_needs_every_seed_below_and_a_1_5x_speedup():
    contiguous = [[(0, 3.0), (10, 2.0), (20, 1.5)], [(0, 3.0), (10, 2.1), (20, 1.5)]]
    rand = [[(0, 3.2), (10, 2.2), (20, 1.6)], [(0, 3.1), (10, 2.3), (20, 1.7)]]
    fast = [[(0, 2.0), (10, 1.4), (20, 1.0)], [(0, 2.1), (10, 1.5), (20, 1.1)]]  # at 1.5 by step 10: 2× sooner
    said = exp.verdict(curves(("optimised", fast), ("contiguous", contiguous), ("random-1000", rand)))
    assert said["verdict"] == "helps" and said["speedup"] == pytest.approx(2.0)
    slow = [[(0, 2.0), (10, 1.6), (20, 1.4)], [(0, 2.1), (10, 1.7), (20, 1.45)]]  # below, but only at step 20
    said = exp.verdict(curves(("optimised", slow), ("contiguous", contiguous), ("random-1000", rand)))
    assert said["verdict"] == "not shown at this budget" and said["below_every_baseline_seed"]
    overlap = [fast[0], [(0, 2.1), (10, 1.5), (20, 1.55)]]  # one seed ends above a contiguous seed
    said = exp.verdict(curves(("optimised", overlap), ("contiguous", contiguous), ("random-1000", rand)))
    assert said["verdict"] == "not shown at this budget" and not said["below_every_baseline_seed"]


def test_missing_ffn_damage_sums_the_edges_into_ffns():
    edges = [{"to": 1, "mass": 10.0, "fraction": 0.5}, {"to": 2, "mass": 100.0, "fraction": 0.0},
             {"to": 3, "mass": 4.0, "fraction": 0.25}]
    assert exp.missing_ffn_damage(edges) == pytest.approx(10 * 0.5 + 4 * 0.75)


def test_a_quick_run_on_a_tiny_model_trains_every_arm_and_says_a_verdict(tmp_path, capsys):
    model_dir = tmp_path / "model"
    tiny_model("llama").save_pretrained(model_dir)
    for seed, name in enumerate(("calib", "train", "eval", "eval2")):  # four different texts: nothing held out
        np.save(tmp_path / f"{name}.npy", np.random.default_rng(seed).integers(0, 97, size=4 * 32))
    results = exp.main(["--quick", "--model", str(model_dir), "--devices", "2", "--schedules", "dtp:2",
                        "--calib", str(tmp_path / "calib.npy"), "--train", str(tmp_path / "train.npy"),
                        "--eval", str(tmp_path / "eval.npy"), "--eval2", str(tmp_path / "eval2.npy"),
                        "--other", "dtp:1", "--work", str(tmp_path / "work")])
    out = capsys.readouterr().out
    assert exp.VERDICT_RULE in out
    row = results["dtp:2"]
    assert row["device"] == ("cuda:0" if torch.cuda.is_available() else "cpu")  # --device auto
    arms = {"optimised", "optimised-other", "contiguous", "random-1000"}
    assert set(row["final_kl"]) == arms and all(len(v) == 2 for v in row["final_kl"].values())
    assert row["verdict"]["verdict"] in ("helps", "not shown at this budget")
    # the amended rule reads every (layout, seed) run, the second domain's KL included; one layout an arm
    assert row["amended_verdict"]["counts"]["optimised"] == {"layouts": 1, "seeds": 2, "runs": 2}
    assert row["amended_verdict"]["verdict"] in ("not decided", "not applicable at this budget")
    # the second domain's final KL per arm and seed, and no checkpoint left behind once it is measured
    assert {arm: len(v) for arm, v in row["final_kl_second_domain"].items()} == dict.fromkeys(arms, 2)
    assert all(kl > 0 for v in row["final_kl_second_domain"].values() for kl in v)
    assert not list((tmp_path / "work").rglob("checkpoint"))
    assert row["predictors"]["J_damage"]["optimised"] >= row["predictors"]["J_damage"]["contiguous"]
    # the runs file, the verdicts' only input: every (layout, seed) run with both domains' KL
    rows = exp.main(["verdicts", "--json", "--runs", str(tmp_path / "work" / "schedule_runs")])
    (mine,) = [r for r in rows if r["file"] == "dtp-2-2steps.json"]
    # both domains as curves: the second evaluated at every step the primary is (each evaluation's checkpoint)
    kept = json.loads((tmp_path / "work" / "schedule_runs" / "dtp-2-2steps.json").read_text())["runs"]
    assert kept and all([s for s, _ in r["second"]] == [s for s, _ in r["primary"]] == [0, 1, 2] for r in kept)
    assert all(r["second"][0][1] != r["second"][-1][1] for r in kept)  # trained: the curve moves
    assert mine["verdict"] == row["amended_verdict"]["verdict"] and mine["final_kl"]["optimised"] == \
        row["final_kl"]["optimised"]
    assert mine["final_kl_second_domain"]["contiguous"] == row["final_kl_second_domain"]["contiguous"]
    saved = json.loads((tmp_path / "work" / "results.json").read_text())
    assert saved["verdict_rule"] == exp.VERDICT_RULE and set(saved["schedules"]) == {"dtp:2"}
    again = exp.main(["--quick", "--model", str(model_dir), "--devices", "2", "--schedules", "dtp:2",
                      "--calib", str(tmp_path / "calib.npy"), "--train", str(tmp_path / "train.npy"),
                      "--eval", str(tmp_path / "eval.npy"), "--eval2", str(tmp_path / "eval2.npy"), "--other", "dtp:1",
                        "--work", str(tmp_path / "work")])
    assert again["dtp:2"]["final_kl"] == row["final_kl"]  # resumed: nothing retrained
    # --arms trains only the layouts named (a set split over the cores) and reads every finished run
    common = ["--quick", "--model", str(model_dir), "--devices", "2", "--schedules", "dtp:2", "--calib",
              str(tmp_path / "calib.npy"), "--train", str(tmp_path / "train.npy"), "--eval", str(tmp_path / "eval.npy"),
              "--eval2", str(tmp_path / "eval2.npy"), "--other", "dtp:1", "--work", str(tmp_path / "work")]
    assert exp.main([*common, "--arms", "contiguous"])["dtp:2"]["final_kl"] == row["final_kl"]
    with pytest.raises(SystemExit, match=r"--arms 'contiguous,optimised-seed9': optimised-seed9 not among dtp:2's "
                                         r"layouts \(contiguous, optimised, optimised-other, random-1000\)"):
        exp.main([*common, "--arms", "contiguous,optimised-seed9"])
    step0 = exp.main(["--quick", "--step0-only", "--model", str(model_dir), "--devices", "2", "--schedules",
                      "dtp:2", "--calib", str(tmp_path / "calib.npy"), "--train", str(tmp_path / "train.npy"),
                      "--eval", str(tmp_path / "eval.npy"), "--eval2", str(tmp_path / "eval2.npy"), "--other", "dtp:1",
                        "--work", str(tmp_path / "work")])["dtp:2"]
    assert set(step0["step0_kl"]) == arms and step0["verdict"] is None
    for arm in arms:  # evaluated on the held-out blocks that training's step 0 evaluates
        assert step0["step0_kl"][arm][0] == pytest.approx(row["curves"][arm][0][0][1], rel=1e-4)
    for p in exp.PREDICTORS:  # one value an arm: every unequal pair is compared
        assert len(step0["ranking"][p]) == sum(a != b for a, b in itertools.combinations(
            [v[0] for v in step0["step0_kl"].values()], 2))
    # the page is written from the result files alone, and a hand-written reading under the mark survives
    page = tmp_path / "schedules.md"
    common = ["--quick", "--model", str(model_dir), "--devices", "2", "--schedules", "dtp:2 pt:2",
              "--work", str(tmp_path / "work"), "--report", str(page)]
    exp.main(common)
    text = page.read_text()
    assert exp.VERDICT_RULE in text and "Not run yet: pt:2" in text
    for arm in arms:
        assert f"| {arm} | {row['predictors']['J_damage'][arm]:.3f} |" in text
    assert f"Verdict: **{row['verdict']['verdict']}**" in text
    assert f"Amended rule (issue 45): **{row['amended_verdict']['verdict']}** (" in text
    page.write_text(text + "Reading written by hand.\n")
    exp.main(common)
    assert page.read_text().endswith("Reading written by hand.\n") and page.read_text().count("## Verdicts") == 1



@pytest.mark.skipif(torch.cuda.is_available(), reason="refuses a GPU that torch cannot see: this one can")
def test_a_cuda_device_torch_cannot_see_is_refused_before_the_model_loads(tmp_path):
    refused = r"--device cuda:1: device 'cuda:1' requested but CUDA is not available; use --device cpu or auto"
    with pytest.raises(SystemExit, match=refused):
        exp.main(["--quick", "--model", str(tmp_path / "never-loaded"), "--device", "cuda:1", "--schedules", "dtp:2",
                  "--work", str(tmp_path / "work")])


def test_the_amended_rules_second_optimised_and_random_layouts_are_built_and_a_repeat_is_refused(tmp_path):
    model_dir = tmp_path / "model"
    tiny_model("llama").save_pretrained(model_dir)
    for seed, name in enumerate(("calib", "train", "eval")):
        np.save(tmp_path / f"{name}.npy", np.random.default_rng(seed).integers(0, 97, size=4 * 32))
    common = ["--quick", "--step0-only", "--model", str(model_dir), "--devices", "2", "--schedules", "dtp:2",
              "--calib", str(tmp_path / "calib.npy"), "--train", str(tmp_path / "train.npy"),
              "--eval", str(tmp_path / "eval.npy"), "--optimised-layouts", "2", "--random-layouts", "2"]
    # no restarts: every seed's optimiser starts from contiguous only, so seed 1 gives seed 0's layout again
    with pytest.raises(SystemExit, match=r"dtp:2: optimised-seed1 is optimised's layout again \(--restarts 0, "
                                         r"--second-optimised restarts\); raise --restarts, give --second-optimised "
                                         r"calibration"):
        exp.main([*common, "--work", str(tmp_path / "w0")])
    assert not list((tmp_path / "w0").rglob("layouts/*/*.json"))  # all or none: no one-layout set left to resume
    row = exp.main([*common, "--restarts", "3", "--work", str(tmp_path / "w3")])["dtp:2"]
    assert set(row["step0_kl"]) == {"optimised", "optimised-seed1", "contiguous", "random-1000", "random-1001"}
    layouts = tmp_path / "w3" / "layouts" / "dtp-2"
    first, second = (json.loads((layouts / f"{n}.json").read_text()) for n in ("optimised", "optimised-seed1"))
    assert first != second and second["score"]["restarts"] == 3
    # or from a calibration subset: the optimiser (seed 0, no restarts) on the second half of the calibration blocks
    row = exp.main([*common, "--second-optimised", "calibration", "--work", str(tmp_path / "wc")])["dtp:2"]
    assert set(row["step0_kl"]) == {"optimised", "optimised-calib1", "contiguous", "random-1000", "random-1001"}
    full, half = (AffinityResult.load(tmp_path / "wc" / "affinity" / d / AFFINITY_FILE)
                  for d in ("dtp-2", "dtp-2-calib1of2"))
    assert half.tokens * 2 == full.tokens and half.metadata["calibration_part"] == "1/2"
    layouts = tmp_path / "wc" / "layouts" / "dtp-2"
    first, second = (layout_file.load(layouts / f"{n}.json") for n in ("optimised", "optimised-calib1"))
    assert not np.array_equal(first.neuron_device, second.neuron_device)
    # scored in J_σ of the full calibration's affinity, as every other arm is, not of the half it was built on
    dtp2 = resolve_schedule("dtp:2", full.shape.num_layers, 2)
    on_full, on_half = (score_both(r, second.kv_group_device, second.neuron_device, 2, dtp2)["fo"]["J"]
                        for r in (full, half))
    assert second.score is not None and second.score["J"] == pytest.approx(on_full)
    assert on_full != pytest.approx(on_half)
    # a calibration subset with the whole calibration's optimum is refused by what would change it, not by the
    # option already given
    from bench.schedule_experiment_runs import refuse_a_layout_again

    again = dataclasses.replace(first, name="optimised-calib1")  # its placement is the first's
    with pytest.raises(SystemExit, match=r"optimised-calib1 is optimised's layout again \(--restarts 0, "
                                         r"--second-optimised calibration\); the calibration subset has the whole "
                                         r"calibration's optimum: give a longer --calib") as refused:
        refuse_a_layout_again("dtp:2", again, {"optimised": first}, 0, "calibration")
    assert "give --second-optimised calibration" not in str(refused.value)


def test_a_run_still_training_in_another_process_is_not_read_as_finished(tmp_path):
    """A set split over the cores (`--seeds`): one process ends while the other is midway through a run whose
    metrics.json holds its first evaluations; that run is left out of the curves, not read as ending there."""
    from bench.schedule_experiment_runs import finished_curves

    for layout, seed, steps, finished in (("contiguous", 0, (0, 10, 20), True), ("random-1001", 0, (0, 10), False)):
        run = tmp_path / "runs" / layout / f"seed-{seed}"
        run.mkdir(parents=True)
        records = [{"layout": layout, "seed": seed, "step": s, "kl": 5.0 - s / 10} for s in steps]
        (run / "metrics.json").write_text(json.dumps({"records": records}))
        if finished:
            (run / "secondary.json").write_text(json.dumps({"kl": 4.0, "curve": [[20, 4.0]]}))
    curves, running = finished_curves(tmp_path)
    assert curves == {"contiguous": {0: [(0, 5.0), (10, 4.0), (20, 3.0)]}} and running == ["random-1001/seed-0"]


def test_a_run_claimed_by_a_live_process_is_left_to_it_and_a_dead_ones_claim_is_taken_over(tmp_path):
    """Two processes splitting a set over the cores on one work directory never train the same run."""
    import subprocess
    import sys

    from bench.schedule_experiment_runs import CLAIM_FILE, claim

    run = tmp_path / "runs" / "random-1000" / "seed-1"
    with claim(run) as other:
        assert other is None and (run / CLAIM_FILE).read_text() == str(os.getpid())
    assert not (run / CLAIM_FILE).exists()  # released after the run
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (run / CLAIM_FILE).write_text(str(holder.pid))
        with claim(run) as other:
            assert other == holder.pid  # alive: its run, not this process's
        assert (run / CLAIM_FILE).read_text() == str(holder.pid)
    finally:
        holder.kill()
        holder.wait()
    with claim(run) as other:  # its process is gone: the claim is stale and taken over
        assert other is None and (run / CLAIM_FILE).read_text() == str(os.getpid())

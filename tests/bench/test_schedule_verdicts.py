"""The amended verdict rule (issue 45) on hand-made curves; every expected figure is worked out by hand here.

Interpolated step at which a curve reaches KL T between evaluations (s0, k0) and (s1, k1), k0 > T ≥ k1:
s0 + (k0 − T) / (k0 − k1) · (s1 − s0).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import schedule_experiment as exp
from bench import schedule_verdicts as sv

STEPS = (0, 10, 20, 30, 40, 50)


def run(arm: str, layout: str, seed: int, kls: tuple[float, ...]) -> sv.Run:
    return sv.Run(arm, layout, seed, tuple(zip(STEPS, kls, strict=True)))


# contiguous: one layout, two seeds; mean curve 5.0, 3.0, 2.0, 1.7, 1.56, 1.5 — reaches its final 1.5 at step 50
CONTIGUOUS = [run("contiguous", "contiguous", 0, (5.0, 3.1, 2.1, 1.75, 1.58, 1.45)),
              run("contiguous", "contiguous", 1, (5.0, 2.9, 1.9, 1.65, 1.54, 1.55))]
RANDOM = [run("random", "random-1000", 0, (6.0, 3.2, 2.2, 1.8, 1.65, 1.60)),
          run("random", "random-1001", 0, (6.0, 3.3, 2.3, 1.9, 1.70, 1.62))]
# each optimised run at 1.5 between step 20 and 30: 20 + (1.8 − 1.5) / (1.8 − 1.4) · 10 = 27.5 → 50 / 27.5 = 1.818×
FAST = [run("optimised", "optimised", 0, (4.0, 2.5, 1.8, 1.4, 1.3, 1.25)),
        run("optimised", "optimised-seed1", 0, (4.0, 2.5, 1.8, 1.4, 1.3, 1.26))]


def test_two_layouts_an_arm_below_every_baseline_run_and_1_5x_sooner_helps():
    said = sv.amended_verdict([*CONTIGUOUS, *RANDOM, *FAST])
    assert said["verdict"] == sv.HELPS
    assert said["target_kl"] == pytest.approx(1.5) and said["contiguous_reaches_at"] == pytest.approx(50.0)
    assert said["optimised_reach_at"] == pytest.approx([27.5, 27.5])
    assert said["speedup_range"] == pytest.approx([50 / 27.5, 50 / 27.5])
    assert said["counts"] == {"optimised": {"layouts": 2, "seeds": 1, "runs": 2},
                              "contiguous": {"layouts": 1, "seeds": 2, "runs": 2},
                              "random": {"layouts": 2, "seeds": 1, "runs": 2}}


def test_one_run_of_the_second_random_layout_below_an_optimised_run_is_not_shown():
    close = run("random", "random-1001", 1, (6.0, 3.3, 2.3, 1.9, 1.50, 1.255))  # below optimised-s1's 1.26
    said = sv.amended_verdict([*CONTIGUOUS, *RANDOM, close, *FAST])
    assert said["verdict"] == sv.NOT_SHOWN and not said["below_every_baseline_run"]


def test_the_speedup_is_read_between_evaluations_dtp2_at_50_steps():
    # dtp:2's recorded optimised seeds at steps 20, 30, 40 against contiguous's final mean 1.495 (its mean curve
    # reaches it at step 50). The slowest seed: 30 + (1.517 − 1.495) / (1.517 − 1.397) · 10 = 31.833 → 1.571×;
    # on the grid of evaluations that seed is first at or below 1.495 at step 40: 1.25×, "not shown".
    cont = [run("contiguous", "contiguous", 0, (5.683, 2.7, 1.95, 1.66, 1.54, 1.495))]
    opt = [run("optimised", "optimised", 0, (4.959, 2.36, 1.724, 1.489, 1.383, 1.343)),
           run("optimised", "optimised-seed1", 1, (4.959, 2.33, 1.732, 1.517, 1.397, 1.348))]
    rand = [run("random", f"random-{k}", 0, (7.8, 2.7, 2.0, 1.73, 1.62, 1.57)) for k in (1000, 1001)]
    said = sv.amended_verdict([*cont, *opt, *rand])
    assert said["speedup"] == pytest.approx(50 / (30 + 0.022 / 0.120 * 10))
    assert said["speedup"] == pytest.approx(1.571, abs=5e-4) and said["verdict"] == sv.HELPS
    old = exp.verdict({"optimised": {r.seed: list(r.primary) for r in opt},
                       "contiguous": {0: list(cont[0].primary)}, "random-1000": {0: list(rand[0].primary)}})
    assert old["speedup"] == pytest.approx(1.25) and old["verdict"] == "not shown at this budget"


def test_a_run_between_the_grid_and_the_bar_the_grid_would_round_away():
    # reaches 1.5 at 20 + (1.9 − 1.5) / (1.9 − 1.3) · 10 = 26.667 → 1.875× interpolated; the grid says step 30:
    # 1.67×. A seed at 1.52 at step 30 and 1.40 at step 40: 30 + 0.02 / 0.12 · 10 = 31.667 → 1.579×; grid 1.25×.
    steps = sv.rule_speedup([c.primary for c in CONTIGUOUS],
                            [run("optimised", "o", 0, (4.0, 2.5, 1.9, 1.3, 1.2, 1.1)).primary,
                             run("optimised", "o", 1, (4.0, 2.5, 1.9, 1.52, 1.40, 1.3)).primary])
    assert steps["candidate_steps"] == pytest.approx([80 / 3, 95 / 3])
    assert steps["per_run"] == pytest.approx([1.875, 50 / (95 / 3)]) and steps["speedup"] == pytest.approx(1.5789,
                                                                                                          abs=1e-4)


def test_contiguous_at_its_final_kl_at_step_0_is_not_applicable_never_an_infinite_speedup():
    # spd:auto:8's shape: training raises every arm; contiguous starts at 0.088, ends at 0.096
    cont = [run("contiguous", "contiguous", s, (0.088, 0.124, 0.127, 0.112, 0.102, 0.096)) for s in (0, 1)]
    opt = [run("optimised", name, 0, (0.048, 0.096, 0.109, 0.098, 0.091, 0.086))
           for name in ("optimised", "optimised-seed1")]
    rand = [run("random", name, 0, (0.082, 0.121, 0.118, 0.107, 0.098, 0.093))
            for name in ("random-1000", "random-1001")]
    said = sv.amended_verdict([*cont, *opt, *rand])
    assert said["verdict"] == sv.NOT_APPLICABLE and said["speedup"] is None
    assert said["contiguous_reaches_at"] == 0.0 and said["training_lowered"] == dict.fromkeys(
        ("optimised", "contiguous", "random"), False)
    assert "lowers no arm" in said["why"]
    # the registered rule: 0 steps against 0 is no speedup (it said inf, and "helps")
    old = exp.verdict({"optimised": {0: list(opt[0].primary)}, "contiguous": {0: list(cont[0].primary)},
                       "random-1000": {0: list(rand[0].primary)}})
    assert old["speedup"] is None and old["verdict"] == "not shown at this budget"
    assert old["below_every_baseline_seed"]


def test_an_optimised_run_at_the_target_before_training_is_unbounded_not_undefined():
    at_once = run("optimised", "optimised", 0, (1.4, 1.3, 1.2, 1.1, 1.0, 0.9))  # below 1.5 from step 0
    speed = sv.rule_speedup([c.primary for c in CONTIGUOUS], [at_once.primary, FAST[0].primary])
    assert speed["applicable"] and speed["per_run"] == pytest.approx([float("inf"), 50 / 27.5])
    assert speed["speedup"] == pytest.approx(50 / 27.5)


def test_one_layout_per_arm_is_not_decided():
    said = sv.amended_verdict([*CONTIGUOUS, RANDOM[0], *FAST])  # one random layout
    assert said["verdict"] == sv.NOT_DECIDED and "1 random" in said["why"]
    again = run("optimised", "optimised", 1, (4.0, 2.5, 1.8, 1.4, 1.3, 1.26))  # the same layout, another seed
    said = sv.amended_verdict([*CONTIGUOUS, *RANDOM, FAST[0], again])
    assert said["verdict"] == sv.NOT_DECIDED and said["counts"]["optimised"] == {"layouts": 1, "seeds": 2, "runs": 2}
    assert sv.amended_verdict([*RANDOM, *FAST])["verdict"] == sv.NOT_DECIDED  # no contiguous run


def test_a_never_reaching_run_counts_as_no_speedup():
    slow = run("optimised", "optimised-s2", 0, (4.0, 3.5, 3.0, 2.5, 2.0, 1.51))  # above 1.5 at every evaluation
    said = sv.amended_verdict([*CONTIGUOUS, *RANDOM, *FAST, slow])
    assert said["speedup"] == 0.0 and said["optimised_reach_at"][-1] is None and said["verdict"] == sv.NOT_SHOWN


def test_arms_by_layout_name():
    assert [sv.arm_of(n) for n in ("optimised", "optimised-seed1", "optimised-calib1", "optimised-other",
                                   "contiguous", "random-1000", "optimised-broken", "optimised-skip1")] == [
        "optimised", "optimised", "optimised", "other", "contiguous", "random", "other", "other"]


# ---- the speedup across budgets ------------------------------------------------------------------------------

LONG_STEPS = (0, 50, 100, 150, 200)


def long_run(arm: str, layout: str, seed: int, kls: tuple[float, ...]) -> sv.Run:
    return sv.Run(arm, layout, seed, tuple(zip(LONG_STEPS, kls, strict=True)))


# 200 steps: contiguous's mean curve 5.0, 2.0, 1.5, 1.2, 1.0 reaches its final 1.0 at step 200
LONG_BASE = [long_run("contiguous", "contiguous", 0, (5.0, 2.1, 1.55, 1.25, 0.95)),
             long_run("contiguous", "contiguous", 1, (5.0, 1.9, 1.45, 1.15, 1.05)),
             long_run("random", "random-1000", 0, (6.0, 2.2, 1.7, 1.3, 1.1)),
             long_run("random", "random-1001", 0, (6.0, 2.3, 1.8, 1.4, 1.2))]
# at 1.0: 50 + (1.5 − 1.0) / (1.5 − 0.5) · 50 = 75 → 200 / 75 = 2.667×; 50 + 0.6 / 1.0 · 50 = 80 → 2.5×;
# 100 + (1.4 − 1.0) / (1.4 − 1.0) · 50 = 150 → 1.333×
AT_75 = (4.0, 1.5, 0.5, 0.45, 0.4)
AT_80 = (4.0, 1.6, 0.6, 0.5, 0.45)
AT_150 = (4.0, 1.8, 1.4, 1.0, 0.9)


@pytest.mark.parametrize(("first", "second", "verdict", "long_range"), [
    (AT_75, AT_80, sv.GROWS, [2.5, 200 / 75]),  # 2.5–2.67× above the 50-step runs' 1.818×
    (AT_150, AT_150, sv.SHRINKS, [200 / 150, 200 / 150]),  # 1.33× below them
    (AT_75, AT_150, sv.UNRESOLVED, [200 / 150, 200 / 75]),  # 1.33–2.67× straddles them
])
def test_the_speedup_across_budgets_compares_the_runs_ranges_whole(first, second, verdict, long_range):
    long = [*LONG_BASE, long_run("optimised", "optimised", 0, first),
            long_run("optimised", "optimised-seed1", 0, second)]
    said = sv.growth([*CONTIGUOUS, *RANDOM, *FAST], long)
    assert said["verdict"] == verdict
    assert said["short_range"] == pytest.approx([50 / 27.5, 50 / 27.5])
    assert said["long_range"] == pytest.approx(long_range)
    assert not said["long_reaches_paper"]  # 2.9×: not reached by 2.5×


def test_the_speedup_across_budgets_needs_the_rules_layouts_at_both(tmp_path, capsys):
    one_layout = [*LONG_BASE, long_run("optimised", "optimised", 0, AT_75)]
    said = sv.growth([*CONTIGUOUS, *RANDOM, *FAST], one_layout)
    assert said == {"verdict": sv.NOT_DECIDED, "why": "the longer budget is not decided"}
    # in the table: the longer budget's row carries the comparison with the schedule's shortest committed budget
    long = [*LONG_BASE, long_run("optimised", "optimised", 0, AT_75),
            long_run("optimised", "optimised-seed1", 0, AT_80)]
    sv.write_runs(sv.runs_file(tmp_path, "dtp:1", 50), "dtp:1", 50, [*CONTIGUOUS, *RANDOM, *FAST])
    sv.write_runs(sv.runs_file(tmp_path, "dtp:1", 200), "dtp:1", 200, long)
    rows = {(r["schedule"], r["steps"]): r for r in exp.main(["verdicts", "--runs", str(tmp_path)])}
    assert "growth" not in rows["dtp:1", 50] and rows["dtp:1", 200]["growth"]["verdict"] == sv.GROWS
    assert rows["dtp:1", 200]["growth"]["from_steps"] == 50
    out = capsys.readouterr().out
    assert "dtp:1 at 200 steps: helps" in out
    assert "the speedup from 50 steps: grows (runs 1.82×–1.82× at the shorter budget, 2.50×–2.67× at the longer)" in out


# ---- the committed runs files and the verdicts command ------------------------------------------------------

REPO = Path(__file__).resolve().parents[2]
# Re-run under the amended rule (2 optimised and 2 random layouts, 3 seeds): the verdict the command gives.
RERUN = {("dtp:1", 50): "helps", ("pt:2", 50): "helps", ("dtp:2", 50): "helps",
         ("dtp:1@15", 50): "helps", ("pt:4", 50): "not shown at this budget",
         ("spd:auto:8", 50): "not applicable at this budget", ("dtp:1", 200): "helps"}
RECOVERED = {("dtp:2", 50): "docs/schedules_other_dtp2.json", ("dtp:2", 100): "docs/schedules_dtp2_100steps.json",
             ("pt:4", 100): "docs/schedules_pt4_100steps.json"}
# issue 29's runs of a schedule since re-run (one layout an arm), kept beside the re-run: the page's first table
# reads them
FIRST_RUNS = sv.RUNS_DIR / "issue29"


def recovered_runs_dir(schedule: str, steps: int) -> Path:
    return FIRST_RUNS if (schedule, steps) in RERUN else sv.RUNS_DIR


def doc_verdict_table() -> dict[str, list[str]]:
    """docs/schedules.md's verdict table: {schedule: [verdict, optimised, contiguous, random, speedup]}."""
    text = (REPO / "docs" / "schedules.md").read_text()
    table = text[text.index("## Verdicts"):].split("\n\n")[1]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()[2:]]
    return {r[0]: r[1:] for r in rows}


@pytest.mark.parametrize(("schedule", "steps"), sorted(RECOVERED))
def test_each_runs_file_holds_the_committed_result_files_curves(schedule, steps):
    about, runs = sv.load_runs(sv.runs_file(recovered_runs_dir(schedule, steps), schedule, steps))
    recorded = json.loads((REPO / RECOVERED[schedule, steps]).read_text())
    assert about["schedule"] == schedule and about["steps"] == steps and about["format"] == sv.RUNS_FORMAT
    assert {(r.layout, r.seed) for r in runs} == {(a, int(s)) for a, c in recorded["curves"].items() for s in c}
    for r in runs:
        assert [list(p) for p in r.primary] == recorded["curves"][r.layout][str(r.seed)]
        assert r.second == ((steps, recorded["final_kl_second_domain"][r.layout][r.seed]),)  # seeds 0, 1, 2 in order


def test_the_verdicts_command_recomputes_the_docs_table_where_the_runs_are_committed(capsys):
    rows = {(r["schedule"], r["steps"]): r for r in exp.main(["verdicts", "--json"])}
    printed = json.loads(capsys.readouterr().out)
    assert [(r["schedule"], r["steps"]) for r in printed] == list(sv.TABLE)
    doc = doc_verdict_table()
    for schedule, steps in sv.TABLE:
        row = rows[schedule, steps]
        if (schedule, steps) in RERUN:  # re-run under the amended rule: its lines of the command are the page's
            assert row["verdict"] == RERUN[schedule, steps] and row["counts"]["optimised"]["layouts"] >= 2
            assert row["counts"]["random"]["layouts"] >= 2
            text = (REPO / "docs" / "schedules.md").read_text()
            assert f"{schedule} at {steps} steps: {row['verdict']} ({row['why']})" in text
            assert f"interpolated: {sv.speedup_spread(row)}" in text  # "–" where the speedup does not apply
            if "growth" in row:  # a longer budget: the page gives GROWTH_RULE's verdict as the command prints it
                grown = row["growth"]
                assert f"the speedup from {grown['from_steps']} steps: {grown['verdict']} ({grown['why']})" in text
            if (schedule, steps) not in RECOVERED:
                continue
            row = sv.table_row(schedule, steps, FIRST_RUNS)  # issue 29's runs, which the page's first table reads
        elif (schedule, steps) not in RECOVERED:  # no raw runs committed: nothing invented
            assert row["verdict"] == sv.LOST and set(row) == {"schedule", "steps", "file", "verdict"}
            continue
        finals = row["final_kl"]
        if steps == 50:  # the table's own row, recomputed from the runs alone by the registered rule
            verdict, optimised, contiguous, random, speedup = doc[schedule]
            assert [sv.spread(finals[a]) for a in ("optimised", "contiguous", "random")] == [
                optimised, contiguous, random]
            assert row["registered"]["verdict"] == verdict and f"{row['registered']['speedup']:.2f}×" == speedup
        else:  # the 100-step runs are in the page's prose: each arm's range and the grid's speedup
            text = (REPO / "docs" / "schedules.md").read_text().replace("\n  ", " ")
            for arm in ("optimised", "contiguous", "random"):
                assert f"{arm} {min(finals[arm]):.3f}–{max(finals[arm]):.3f}" in text
            assert f"{row['registered']['speedup']:.2f}×, short of" in text or \
                f"{row['registered']['speedup']:.2f}×, so" in text
        # one layout an arm in every recorded run: the amended rule cannot decide them
        assert row["verdict"] == sv.NOT_DECIDED and row["counts"]["optimised"] == {"layouts": 1, "seeds": 3, "runs": 3}
    first = sv.table_row("dtp:2", 50, FIRST_RUNS)
    assert first["speedup"] == pytest.approx(1.571, abs=5e-4)  # the interpolated figure


def test_the_text_table_says_which_runs_must_be_rerun(tmp_path, capsys):
    _, runs = sv.load_runs(sv.runs_file(FIRST_RUNS, "dtp:2", 50))
    sv.write_runs(sv.runs_file(tmp_path, "dtp:2", 50), "dtp:2", 50, runs, resolved="dtp:2")
    exp.main(["verdicts", "--runs", str(tmp_path)])
    out = capsys.readouterr().out
    assert "dtp:1 at 50 steps: raw runs not in the repository: re-run needed" in out  # not in tmp_path
    assert "dtp:2 at 50 steps: not decided (1 optimised and 1 random layout(s); the rule needs 2 of each)" in out
    assert "1.57× (runs 1.57×–1.68×, 3 runs)" in out and "not shown at this budget, 1.25× on the grid" in out
    at_once = {"speedup_range": [float("inf"), float("inf")], "counts": {"optimised": {"runs": 1}}}
    assert sv.speedup_spread(at_once) == "∞ (at the target before training) (one run)"
    (tmp_path / "x-2steps.json").write_text(json.dumps({"format": "something else", "runs": []}))
    with pytest.raises(ValueError, match=r"x-2steps\.json: format 'something else'"):
        exp.main(["verdicts", "--runs", str(tmp_path)])

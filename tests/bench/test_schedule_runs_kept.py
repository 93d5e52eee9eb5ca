"""bench/schedule_runs_kept.py: a schedule's finished runs kept in the repository and restored into a new work
directory only for the layouts they trained."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import schedule_experiment as exp
from bench import schedule_runs_kept as kept


def finished_run(work: Path, layout: str, seed: int, kl: float, done: bool = True) -> None:
    run = work / "distill" / "pt-4" / "runs" / layout / f"seed-{seed}"
    run.mkdir(parents=True)
    (run / "metrics.json").write_text(json.dumps({"records": [{"layout": layout, "seed": seed, "step": 50,
                                                               "kl": kl}]}))
    if done:  # an unfinished run has no secondary.json yet
        (run / "secondary.json").write_text(json.dumps({"kl": kl + 0.5}))


def placement(neurons: list[int], j: float = 30.3) -> str:
    return json.dumps({"format": "dtp-layout/1", "devices": 3, "delta": 1, "schedule": "pt:4",
                       "kv_group_device": [[0, 1, 2]], "neuron_device": [neurons], "score": {"J": j}})


def layouts(work: Path, **files: str) -> Path:
    out = work / "layouts" / "pt-4"
    out.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (out / f"{name}.json").write_text(text)
    return out


def test_finished_runs_are_kept_and_restored_where_missing(tmp_path):
    first, root = tmp_path / "first", tmp_path / "kept"
    layouts(first, optimised=placement([0, 1, 2]), contiguous=placement([0, 0, 1]))
    finished_run(first, "optimised", 0, 1.1)
    finished_run(first, "contiguous", 0, 1.4)
    finished_run(first, "contiguous", 1, 9.9, done=False)
    assert kept.keep(first, "pt:4", 50, root) == ["contiguous/seed-0", "optimised/seed-0"]
    out = root / "pt-4-50steps"
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*.json")) == [
        "layouts.json", "runs/contiguous/seed-0/metrics.json", "runs/contiguous/seed-0/secondary.json",
        "runs/optimised/seed-0/metrics.json", "runs/optimised/seed-0/secondary.json"]
    second = tmp_path / "second"
    # rebuilt elsewhere: the same placements, their scores' last bits not
    built = layouts(second, optimised=placement([0, 1, 2], 30.30000000000001), contiguous=placement([0, 0, 1]))
    finished_run(second, "optimised", 0, 1.2)  # finished here already: its own result is kept
    assert kept.restore_kept(second, "pt:4", 50, built, root) == ["contiguous/seed-0"]
    run = second / "distill" / "pt-4" / "runs"
    assert json.loads((run / "contiguous" / "seed-0" / "secondary.json").read_text())["kl"] == pytest.approx(1.9)
    assert json.loads((run / "optimised" / "seed-0" / "secondary.json").read_text())["kl"] == pytest.approx(1.7)
    assert kept.restore_kept(second, "pt:4", 100, built, root) == []  # another budget: nothing kept


def test_a_kept_run_of_another_layout_is_refused(tmp_path):
    first, root = tmp_path / "first", tmp_path / "kept"
    layouts(first, optimised=placement([0, 1, 2]))
    finished_run(first, "optimised", 0, 1.1)
    kept.keep(first, "pt:4", 50, root)
    second = tmp_path / "second"
    with pytest.raises(ValueError, match=r"kept run optimised/seed-0 trained layout optimised .* not the same"):
        kept.restore_kept(second, "pt:4", 50, layouts(second, optimised=placement([1, 0, 2])), root)
    with pytest.raises(ValueError, match="layout optimised was kept with another file"):
        layouts(first, optimised=placement([1, 0, 2]))  # the set rebuilt differently, then kept into the same place
        kept.keep(first, "pt:4", 50, root)


def test_the_keep_command_reads_the_experiments_flags(tmp_path, capsys):
    work = tmp_path / "work"
    layouts(work, optimised=placement([0, 1, 2]))
    finished_run(work, "optimised", 2, 1.0)
    said = exp.main(["keep", "--schedules", "pt:4", "--work", str(work), "--kept", str(tmp_path / "kept")])
    assert said == {"pt:4": ["optimised/seed-2"]}
    assert "pt:4 at 50 steps: 1 finished run(s) kept in" in capsys.readouterr().out
    assert (tmp_path / "kept" / "pt-4-50steps" / "runs" / "optimised" / "seed-2" / "metrics.json").exists()


def test_the_whole_layout_set_is_kept_and_starts_a_work_directory_that_has_none(tmp_path):
    # another machine's affinity can move the optimiser: the next machine trains the kept placements, not its own
    first, root = tmp_path / "first", tmp_path / "kept"
    layouts(first, optimised=placement([0, 1, 2]), contiguous=placement([0, 0, 1]),
            **{"random-1000": placement([2, 1, 0])})
    finished_run(first, "optimised", 0, 1.1)  # random-1000 not trained yet: its layout is kept all the same
    kept.keep(first, "pt:4", 50, root)
    packed = root / "pt-4-50steps" / "layouts"
    before = {p.name: p.read_bytes() for p in packed.iterdir()}
    assert sorted(before) == ["contiguous.json.gz", "optimised.json.gz", "random-1000.json.gz"]
    recorded = json.loads((root / "pt-4-50steps" / "layouts.json").read_text())
    assert set(recorded) == {"optimised", "contiguous", "random-1000"}
    second = tmp_path / "second"
    assert kept.restore_layouts(second, "pt:4", 50, root) == ["contiguous", "optimised", "random-1000"]
    for name in ("optimised", "contiguous", "random-1000"):
        assert (second / "layouts" / "pt-4" / f"{name}.json").read_text() == \
            (first / "layouts" / "pt-4" / f"{name}.json").read_text()
    assert kept.restore_kept(second, "pt:4", 50, second / "layouts" / "pt-4", root) == ["optimised/seed-0"]
    # a work directory with its own layouts is used as it is (restore_kept then checks it against the runs)
    third = tmp_path / "third"
    own = layouts(third, optimised=placement([1, 0, 2]))
    assert kept.restore_layouts(third, "pt:4", 50, root) == [] and sorted(p.name for p in own.iterdir()) == [
        "optimised.json"]
    assert kept.restore_layouts(second, "pt:4", 100, root) == []  # another budget: nothing kept
    kept.keep(first, "pt:4", 50, root)  # kept again unchanged: the same bytes (gzip without a time stamp)
    assert {p.name: p.read_bytes() for p in packed.iterdir()} == before

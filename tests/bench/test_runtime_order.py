"""bench/runtime.py's reading of its repeats: a difference between two schedules' growth is called only
when every repeat of one grew less than every repeat of the other (issue 29: only the differences that the
spread resolves)."""

from bench.runtime import resolved_order


def test_neighbours_are_resolved_only_when_the_repeats_do_not_overlap():
    growth = {"tp": [160.0, 170.0, 165.0], "dtp:1": [70.0, 64.0, 84.0], "ladder": [71.0, 83.0, 60.0],
              "dtp:2": [13.0, 28.0, 25.0]}
    (line,) = resolved_order(growth)
    # medians: dtp:2 25, dtp:1 70, ladder 71, tp 165; dtp:1 and ladder overlap (60–83 vs 64–84)
    assert line.endswith("dtp:2 < dtp:1 ≈ ladder < tp"), line


def test_one_overlapping_repeat_leaves_the_pair_unresolved():
    (line,) = resolved_order({"a": [1.0, 2.0, 5.0], "b": [4.5, 6.0, 7.0]})
    assert line.endswith("a ≈ b"), line
    (line,) = resolved_order({"a": [1.0, 2.0, 4.0], "b": [4.5, 6.0, 7.0]})
    assert line.endswith("a < b"), line

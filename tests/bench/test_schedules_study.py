"""bench/schedules_study.py's bookkeeping: which affinity pass may serve which schedule, and the blocking syncs.

Checked against the issue's preset formulas transcribed here (issue 20, "The schedule"), not against
models.schedules.grammar: the study's reuse of one affinity pass for several schedules is only sound when the
serving pass scores every edge b_m ≤ t < a_m of the served schedule.
"""

from __future__ import annotations

import math

import pytest

from bench.schedules_study import affinity_source, blocking_syncs
from models.schedules.grammar import resolve_schedule

LAYERS, DEVICES = 30, 3
M = 2 * LAYERS
INF = math.inf


def table(name: str) -> tuple[list[float], list[float]]:
    """(b_n, a_n) of the issue's presets, literally (the scales do not matter for edges or syncs)."""
    if name.startswith("dtp:"):
        body, _, upper = name[4:].partition("@")
        d, k = int(body), int(upper) if upper else LAYERS
        lo = M - 2 * k  # first converted module
        b = [n + 1 for n in range(M)]
        a: list[float] = [n + 1 if n < lo else (n + d + 1 if n <= M - 1 - d else INF) for n in range(M)]
        return b, a
    if name == "ladder":
        return [min(n + 2, M) for n in range(M)], [min(n + 2, M) for n in range(M)]
    if name.startswith("pt:"):
        D = int(name[3:])
        return [n + 1 for n in range(M)], [min(2 * D * (n // (2 * D) + 1), M) for n in range(M)]
    if name.startswith("spd:"):
        layers = {int(x) for x in name[4:].split(",")}
        return [n + 1 for n in range(M)], [n + 2 if n % 2 == 0 and n // 2 in layers else n + 1 for n in range(M)]
    raise AssertionError(name)


def edges(name: str) -> set[tuple[int, int]]:
    b, a = table(name)
    return {(m, t) for m in range(M) for t in range(m + 1, M) if b[m] <= t < a[m]}


CHAIN = {(n, n + 1) for n in range(M - 1)}


@pytest.mark.parametrize("name", ["dtp:1", "dtp:2", "dtp:1@15", "pt:2", "pt:4", "spd:7,8,17,22,25,26,27,28",
                                  "spd:auto:8"])
def test_the_serving_pass_scores_every_edge_of_the_schedule(name):
    source = affinity_source(name)
    assert source is not None
    served = edges("spd:" + ",".join(map(str, range(0, LAYERS, 3)))) if name == "spd:auto:8" else edges(name)
    scored = CHAIN | edges(source)  # the pass always scores the chain, plus its own schedule's edges
    assert served <= scored, sorted(served - scored)[:5]


def test_layout_independent_schedules_have_no_pass():
    assert affinity_source("ladder") is None and affinity_source("tp") is None
    assert edges("ladder") == set()


@pytest.mark.parametrize(("name", "expected"), [
    ("dtp:1", 0), ("dtp:2", 0),  # every exchange has at least one module to hide behind; the last never sent
    ("ladder", 1),  # only the last module's output, needed before the final norm
    ("pt:2", 15), ("pt:4", 8),  # one per block, at its end: ⌈30/D⌉
    ("spd:1,3,5", M - 3),  # tp's M, less the dropped attention syncs (merged into the FFN's)
    ("dtp:1@15", 30),  # the lower 15 layers as tp
])
def test_blocking_syncs(name, expected):
    _, a = table(name)
    by_hand = len({a[n] for n in range(M) if a[n] == n + 1})
    assert by_hand == expected
    assert blocking_syncs(resolve_schedule(name, LAYERS, DEVICES)) == expected

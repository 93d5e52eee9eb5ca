"""The layout set of an optimise run (§5.4, Table 3): each ablation checked against a slow transcription.

Affinities are small random numpy matrices (no model, no torch), so that every balanced assignment of a
layer can be enumerated: a layout that claims to optimise (or minimise) J over some blocks must beat
every alternative of each of those blocks, found by brute force with the literal double sum of (6).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from models.affinity.names import SCORES
from models.base.shapes import ModelShape
from models.layouts.layout import Layout
from models.optimise import Affinity, contiguous_row
from models.variants.set import (
    LAYER_COUNTS,
    PAPER_REFERENCE,
    ablation_names,
    build_layouts,
    evenly_spaced_layers,
    neuron_agreement,
)
from tests.models.layouts.kit import G, I, L, N, brute_agreement, fake_result, units
from tests.models.optimise.kit import all_balanced, literal_J


def contiguous_arrays(layers: int = N) -> tuple[np.ndarray, np.ndarray]:
    return (np.tile(contiguous_row(G, L), (layers, 1)), np.tile(contiguous_row(I, L), (layers, 1)))


def block_alternatives(lay: Layout, layer: int, part: str):
    """Every layout that differs from `lay` only in one block: layer `layer`'s heads or neurons."""
    for row in all_balanced(G if part == "heads" else I, L):
        heads, cells = lay.kv_group_device.copy(), lay.neuron_device.copy()
        (heads if part == "heads" else cells)[layer] = row
        yield heads, cells


def assert_block_optimal(affinity: Affinity, lay: Layout, layers, parts, maximise: bool = True) -> None:
    here = literal_J(affinity, lay.kv_group_device, lay.neuron_device)
    for layer, part in itertools.product(layers, parts):
        for heads, cells in block_alternatives(lay, layer, part):
            other = literal_J(affinity, heads, cells)
            assert (other <= here + 1e-12) if maximise else (other >= here - 1e-12), (lay.name, layer, part)


@pytest.fixture(scope="module")
def result():
    return fake_result()


@pytest.fixture(scope="module")
def layouts(result):
    return build_layouts(result, devices=L, delta=1, score_name="fo", random_layouts=2, ablations=True, restarts=2)


def test_evenly_spaced_layers_are_the_papers():
    # Figure 9 of the paper (Qwen3-0.6B, 28 layers): the layers whose fractions differ from contiguous.
    assert evenly_spaced_layers(28, 4) == [0, 7, 14, 21]
    assert evenly_spaced_layers(28, 8) == [0, 4, 7, 10, 14, 18, 21, 24]
    assert evenly_spaced_layers(28, 12) == [0, 2, 5, 7, 9, 12, 14, 16, 19, 21, 23, 26]
    # Slow transcription of the rule: k distinct layers from 0, gaps of ⌊N/k⌋ or ⌈N/k⌉; clipped to N.
    for n in range(1, 40):
        for k in LAYER_COUNTS:
            chosen = evenly_spaced_layers(n, k)
            assert chosen[0] == 0 and len(chosen) == min(k, n) and chosen == sorted(set(chosen))
            assert all(0 <= c < n for c in chosen)
            gaps = np.diff([*chosen, n])
            assert gaps.min() >= n // min(k, n) - 1 and gaps.max() <= -(-n // min(k, n)) + 1
    assert evenly_spaced_layers(3, 12) == [0, 1, 2]


def test_the_seven_spread_layouts_and_the_equal_restarts_reference(layouts):
    assert ablation_names("fo") == ["anti-optimised", "heads-only", "neurons-only", "add-score", "4-layers",
                                    "8-layers", "12-layers"]
    assert ablation_names("add")[3] == "fo-score"
    assert ablation_names("fo", restarts=3)[-1] == PAPER_REFERENCE
    assert list(layouts) == ["optimised", *ablation_names("fo", 2), "contiguous", "random-1000", "random-1001"]
    restarts = {name: lay.score["restarts"] for name, lay in layouts.items()}
    assert restarts["optimised"] == 2 and restarts["neurons-only"] == 0 and restarts[PAPER_REFERENCE] == 0
    assert restarts["contiguous"] is None and restarts["anti-optimised"] == 2
    no_restarts = build_layouts(fake_result(), devices=L, delta=1, ablations=True, restarts=0)
    assert PAPER_REFERENCE not in no_restarts and no_restarts["optimised"].score["restarts"] == 0


def test_every_layout_is_scored_in_fo_and_add_units_by_the_literal_sum(result, layouts):
    for name, lay in layouts.items():
        for score in SCORES:
            literal = literal_J(units(result, score), lay.kv_group_device, lay.neuron_device)
            assert lay.score["scores"][score]["J"] == pytest.approx(literal, abs=1e-12), (name, score)
        # The headline J is in the run's units (FO) whichever score built the layout.
        assert lay.score["J"] == lay.score["scores"]["fo"]["J"] and lay.score["score"] == "fo"
    assert layouts["add-score"].score["objective"] == "add" and layouts["optimised"].score["objective"] == "fo"


def test_each_ablation_has_the_papers_structure(result, layouts):
    fo, add = units(result, "fo"), units(result, "add")
    heads0, cells0 = contiguous_arrays()
    everything = range(N)
    assert_block_optimal(fo, layouts["optimised"], everything, ("heads", "neurons"))
    assert_block_optimal(fo, layouts[PAPER_REFERENCE], everything, ("heads", "neurons"))
    # anti-optimised: J minimised, every block a local minimum, below every other layout here.
    anti = layouts["anti-optimised"]
    assert_block_optimal(fo, anti, everything, ("heads", "neurons"), maximise=False)
    assert anti.score["J"] == min(lay.score["J"] for lay in layouts.values())
    # heads-only: neurons contiguous, heads optimal given them; neurons-only the reverse.
    assert (layouts["heads-only"].neuron_device == cells0).all()
    assert_block_optimal(fo, layouts["heads-only"], everything, ("heads",))
    assert (layouts["neurons-only"].kv_group_device == heads0).all()
    assert_block_optimal(fo, layouts["neurons-only"], everything, ("neurons",))
    # The other score's layout optimises ADD, not FO.
    assert_block_optimal(add, layouts["add-score"], everything, ("heads", "neurons"))
    # k layers: 0 and evenly spaced ones optimised, the rest exactly contiguous.
    for k in LAYER_COUNTS:
        lay = layouts[f"{k}-layers"]
        chosen = [round(j * N / min(k, N)) for j in range(min(k, N))]  # N=6, k=4: 0, 1.5→2, 3, 4.5→4
        assert lay.score["layers"] == sorted(set(chosen))
        rest = [i for i in range(N) if i not in chosen]
        assert (lay.kv_group_device[rest] == heads0[rest]).all() and (lay.neuron_device[rest] == cells0[rest]).all()
        assert_block_optimal(fo, lay, chosen, ("heads", "neurons"))
    assert layouts["4-layers"].score["layers"] == [0, 2, 3, 4]


def test_neuron_agreement_is_the_best_relabelling():
    shape = ModelShape("llama", 3, 3, 3, 6)
    rng = np.random.default_rng(4)
    for _ in range(5):
        a, b = (Layout(name, 3, 1, shape, [rng.permutation(contiguous_row(3, 3)) for _ in range(3)],
                       [rng.permutation(contiguous_row(6, 3)) for _ in range(3)]) for name in "ab")
        got = neuron_agreement(a, b)
        assert got["neurons"] == pytest.approx(brute_agreement(a.neuron_device, b.neuron_device, 3))
        assert got["chance"] == pytest.approx(1 / 3) and len(got["neurons_per_layer"]) == 3
    relabelled = Layout("c", 3, 1, shape, (a.kv_group_device + 1) % 3, (a.neuron_device + 1) % 3)
    same = neuron_agreement(a, relabelled)
    assert same["neurons"] == 1.0 and same["kv_groups"] == 1.0


def test_progress_moves_with_every_sweep_and_every_layout_scored(result):
    """A pt:2 job's optimising sat at 0 % for 80 s: build_layouts tells its progress after every optimiser
    sweep and every layout scored. Units, written out: the optimised layout's 1 + 2 ascents, then the
    scoring of optimised, contiguous and random-1000 (one each): 6, each ascent's end and each score a
    sixth; in between, the sweeps of an ascent, without reaching its end. The layouts are the same."""
    told: list[float] = []
    with_progress = build_layouts(result, devices=L, delta=1, random_layouts=1, restarts=2, progress=told.append)
    assert told == sorted(told) and told[-1] == pytest.approx(1.0)
    marks = [k / 6 for k in range(1, 7)]
    assert all(any(t == pytest.approx(m) for t in told) for m in marks), told
    within = [t for t in told if not any(t == pytest.approx(m) for m in marks)]
    assert within and all(0 < t < 0.5 for t in within)  # the sweeps, during the three ascents (half the work)
    without = build_layouts(result, devices=L, delta=1, random_layouts=1, restarts=2)
    assert list(with_progress) == list(without)
    for name, lay in without.items():
        assert np.array_equal(with_progress[name].neuron_device, lay.neuron_device)
        assert np.array_equal(with_progress[name].kv_group_device, lay.kv_group_device)

"""spd:isolated:K (issue 20) and spd:auto:K (the cumulative rule, issue 29) against literal transcriptions.

The literal sensitivity of a set B: the issue's schedule equation for spd:B transcribed per device
(`tests.models.test_schedules.ref_schedule_logits`, on the contiguous layout, i.e. the model as stored),
then KL(dense ‖ spd:B) per token from the two logit tensors by its definition Σ_v p log(p / q), averaged.
The isolated rule ranks the layers by KL(dense ‖ spd:i); the cumulative rule adds, round by round, the
layer whose KL(dense ‖ spd:(chosen ∪ {i})) is least.
"""

from __future__ import annotations

import pytest
import torch

from models.evaluation.spd_auto import least_sensitive, resolve_spd_auto, spd_sensitivities
from models.families import model_shape
from models.layouts.layout import contiguous
from models.schedules.grammar import ScheduleError, parse_schedule
from tests.models.test_schedules import literal_tables, ref_schedule_logits
from tests.tiny import fresh, tokens


def literal_kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    p = torch.softmax(p_logits.double(), -1)
    return float((p * (torch.log(p) - torch.log_softmax(q_logits.double(), -1))).sum(-1).mean())


def test_sensitivities_are_the_literal_kl_of_each_dropped_sync() -> None:
    model = fresh("llama")
    ids = tokens(2, 10)
    devices = 2
    layout = contiguous(model_shape(model.config), devices)
    M = 2 * model.config.num_hidden_layers
    with torch.no_grad():
        dense = model(ids).logits
        expected = [literal_kl(dense, ref_schedule_logits(model, layout, ids, literal_tables(f"spd:{i}", M, devices)))
                    for i in range(M // 2)]
        got = spd_sensitivities(model, ids, devices=devices, batch_size=1)
    assert got == pytest.approx(expected, rel=1e-4, abs=1e-9)
    assert min(expected) > 0 and len(set(expected)) == len(expected)  # the rule has something to choose
    spec, sensitivities, rounds = resolve_spd_auto(parse_schedule("spd:isolated:2"), model, ids, devices=devices)
    order = sorted(range(len(expected)), key=lambda i: expected[i])
    assert spec == parse_schedule("spd:" + ",".join(map(str, sorted(order[:2]))))
    assert sensitivities == pytest.approx(got, rel=1e-12) and rounds == []


def test_the_cumulative_rule_re_measures_with_the_chosen_layers_dropped() -> None:
    model = fresh("llama")
    ids = tokens(2, 10)
    devices = 2
    layout = contiguous(model_shape(model.config), devices)
    M = 2 * model.config.num_hidden_layers
    chosen: list[int] = []
    literal_rounds = []
    with torch.no_grad():
        dense = model(ids).logits
        for _ in range(2):
            kls = {i: literal_kl(dense, ref_schedule_logits(
                model, layout, ids, literal_tables("spd:" + ",".join(map(str, sorted([*chosen, i]))), M, devices)))
                for i in range(M // 2) if i not in chosen}
            literal_rounds.append(kls)
            chosen.append(min(kls, key=lambda i: (kls[i], i)))
        spec, sensitivities, rounds = resolve_spd_auto(parse_schedule("spd:auto:2"), model, ids, devices=devices)
    assert spec == parse_schedule("spd:" + ",".join(map(str, sorted(chosen))))
    assert [sorted(r) for r in rounds] == [sorted(r) for r in literal_rounds]
    for got, want in zip(rounds, literal_rounds, strict=True):
        assert [got[i] for i in sorted(want)] == pytest.approx([want[i] for i in sorted(want)], rel=1e-4, abs=1e-9)
    assert sensitivities == pytest.approx([rounds[0][i] for i in range(M // 2)], rel=1e-12)
    # the second round measures the pairs, not the layers alone: dropped syncs compound
    assert all(rounds[1][i] != pytest.approx(rounds[0][i], rel=1e-3) for i in rounds[1])


def test_least_sensitive_picks_the_lowest_and_breaks_ties_low() -> None:
    assert least_sensitive([0.3, 0.1, 0.2, 0.1], 2) == (1, 3)
    assert least_sensitive([0.3, 0.1, 0.2, 0.1], 3) == (1, 2, 3)
    assert least_sensitive([0.5, 0.5, 0.5], 1) == (0,)
    with pytest.raises(ScheduleError, match=r"K must be in 1 \.\. 3"):
        least_sensitive([0.5, 0.5, 0.5], 4)
    spec, none, no_rounds = resolve_spd_auto(parse_schedule("pt:2"), None, torch.zeros(1, 1), devices=2)
    assert str(spec) == "pt:2" and none == [] and no_rounds == []

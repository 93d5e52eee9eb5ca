"""The runtime under every communication schedule (issue 20): on shards exported for the schedule, the
ranks compute the simulator's function (prefill logits and cached decode steps within 1e-5 in fp32, the
same greedy tokens) for every preset, L ∈ {2, 3}; the exchanges per token are the schedule's syncs;
shards made for another schedule are refused, naming both.

The reference is the single-process simulator (`DTPModel(schedule=...)`) on the model rebuilt from
the same shards; tests/models/test_schedules.py checks that simulator against a literal
transcription of the schedule equation for every preset, family and L ∈ {2, 3, 4}.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from models.runtime import DTPRuntime, ShardError
from models.runtime.arrivals import ArrivalPlan
from models.schedules.grammar import resolve_schedule
from tests.models.runtime.reference import max_logit_error, simulator_generation
from tests.tiny import FAMILY_CASES, tokens

CASES = sorted(FAMILY_CASES)
# Every preset on the tiny models' 3 layers (M = 6 modules), with the extremes of each parameter.
PRESETS = ["tp", "dtp:0", "dtp:1", "dtp:2", "dtp:3", "dtp:1@1", "dtp:2@2", "ladder", "spd:1", "spd:0,2", "pt:1",
           "pt:2", "pt:3"]
DECODE_STEPS = 6
TOL = 1e-5


def check_schedule(rt: DTPRuntime, shards_dir: Any, schedule: str) -> dict[str, Any]:
    info = rt.load(shards_dir)
    assert info.schedule == schedule
    ids = tokens(2, 7, seed=5)
    result = rt.generate(ids.numpy(), max_new_tokens=DECODE_STEPS + 1, schedule=schedule, stop_at_eos=False,
                         return_logits=True)
    prefill, steps, want = simulator_generation(shards_dir, ids, DECODE_STEPS, schedule=schedule)
    error = max_logit_error(result, prefill, steps)
    assert error <= TOL, f"{schedule} L={rt.world_size}: max |Δlogit| {error:.3g}"
    np.testing.assert_array_equal(result.tokens, want.numpy())
    table = resolve_schedule(schedule, 3, rt.world_size)
    assert result.schedule == schedule
    for r in result.ranks:  # one exchange per arrival point: the schedule's syncs per token
        assert r.exchanges_per_token == table.syncs_per_token, (schedule, r)
    return result.as_dict()


@pytest.mark.parametrize("schedule", PRESETS)
def test_two_ranks_run_every_schedule_as_the_simulator(runtime2: DTPRuntime, shards: Any, schedule: str) -> None:
    case = CASES[PRESETS.index(schedule) % len(CASES)]  # every family meets several presets
    check_schedule(runtime2, shards(case, 2, 1, schedule=schedule), schedule)


@pytest.mark.parametrize("schedule", PRESETS)
def test_three_ranks_run_every_schedule_as_the_simulator(runtime3: DTPRuntime, shards: Any, schedule: str) -> None:
    case = CASES[(PRESETS.index(schedule) + 2) % len(CASES)]
    check_schedule(runtime3, shards(case, 3, 1, schedule=schedule), schedule)


def test_schedules_differ_on_the_same_weights(runtime2: DTPRuntime, shards: Any) -> None:
    """Not vacuous: on one set of weights the presets' logits differ by far more than the tolerance."""
    runtime2.load(shards("llama", 2, 1))
    ids = tokens(1, 6, seed=4).numpy()
    logits = {s: runtime2.generate(ids, max_new_tokens=1, schedule_override=s, return_logits=True).prefill_logits
              for s in ("tp", "dtp:1", "ladder", "spd:1", "pt:2")}
    names = sorted(logits)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            assert np.abs(logits[a] - logits[b]).max() > 1e-3, (a, b)


def test_shards_made_for_another_schedule_are_refused(runtime2: DTPRuntime, shards: Any) -> None:
    shards_dir = shards("qwen3", 2, 1, schedule="pt:2")
    runtime2.load(shards_dir)
    ids = tokens(1, 4, seed=1).numpy()
    with pytest.raises(ShardError) as refused:
        runtime2.generate(ids, max_new_tokens=1, schedule="dtp:1")
    assert "'pt:2'" in str(refused.value) and "'dtp:1'" in str(refused.value)
    # dtp:0 is tp's table: the same schedule under another name is not refused.
    tp_dir = shards("qwen3", 2, 1, schedule="tp")
    runtime2.load(tp_dir)
    assert runtime2.generate(ids, max_new_tokens=2, schedule="dtp:0", stop_at_eos=False).schedule == "dtp:0"
    with pytest.raises(ValueError, match="spd:auto:2"):
        runtime2.generate(ids, max_new_tokens=1, schedule_override="spd:auto:2")


def test_shards_without_a_recorded_schedule_read_as_dtp_delta(runtime2: DTPRuntime, shards: Any,
                                                                 tmp_path: Any) -> None:
    """Shards exported before the manifest recorded the schedule run at the manifest's dtp:δ."""
    import shutil

    old = tmp_path / "old"
    shutil.copytree(shards("mistral", 2, 2), old)
    manifest = json.loads((old / "manifest.json").read_text())
    assert manifest.pop("schedule") == "dtp:2"
    (old / "manifest.json").write_text(json.dumps(manifest))
    assert runtime2.load(old).schedule == "dtp:2"
    with pytest.raises(ShardError, match="made for schedule 'dtp:2', not 'dtp:1'"):
        runtime2.generate(tokens(1, 4, seed=1).numpy(), max_new_tokens=1, schedule="dtp:1")


def test_a_manifest_schedule_the_model_cannot_run_is_refused_on_load(runtime2: DTPRuntime, shards: Any,
                                                                        tmp_path: Any) -> None:
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(shards("llama", 2, 1), bad)
    manifest = json.loads((bad / "manifest.json").read_text())
    manifest["schedule"] = "pt:9"  # the model has 3 layers
    (bad / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ShardError, match=r"field 'schedule'.*D must be in 1 \.\. 3"):
        runtime2.load(bad)


@pytest.mark.parametrize("schedule", PRESETS)
def test_the_arrival_plan_adds_every_partial_once_where_the_table_says(schedule: str) -> None:
    """Bookkeeping, symbolically: replaying the plan (own partials as added, exchanges as their members'
    sum over ranks, minus the own ones when those were added already) gives, before each module t, exactly
    the equation's terms {own m: b_m ≤ t, scaled s_m} ∪ {others m: a_m ≤ t}."""
    L = 3
    table = resolve_schedule(schedule, 3, L)
    plan = ArrivalPlan.of(table)
    own: dict[int, float] = {}  # m -> total scale of o_m^l in the stream
    others: dict[int, int] = {}  # m -> how many times Σ_{j≠l} o_m^j was added
    for n in range(table.num_modules):
        t = n + 1
        arrival = plan.arrivals[n]
        for m, scale in arrival.own:
            own[m] = own.get(m, 0.0) + scale
        if arrival.exchange:
            for m in plan.members[t]:
                others[m] = others.get(m, 0) + 1
                if arrival.whole:  # the all-ranks sum includes the own partial
                    own[m] = own.get(m, 0.0) + 1.0
        want_own = {m: table.own_scale[m] for m in range(table.num_modules) if table.own_arrival[m] <= t}
        want_others = {m: 1 for m in range(table.num_modules)
                       if table.other_arrival[m] is not None and table.other_arrival[m] <= t}  # type: ignore[operator]
        assert own == pytest.approx(want_own) and others == want_others, (schedule, t)
    assert plan.exchanges == table.syncs_per_token

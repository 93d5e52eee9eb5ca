"""The runtime on the MoE families' shards (issue 46): two gloo ranks, each holding I_e/L neurons of every expert
and routing its own stream, compute the simulator's function under tp, dtp:1, dtp:2 and pt:2 (prefill logits and
cached decode steps within 1e-5 in fp32, the same greedy tokens); at tp they compute the dense Hugging Face MoE
model's (its own experts loop and KV cache, independent of both).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from models.export.resident import export_rank_shards, permuted_copy
from models.runtime import DTPRuntime
from tests.models.moe_kit import MOE_CASES, balanced_moe_layout, moe_model
from tests.models.runtime.reference import dense_generation, max_logit_error, simulator_generation
from tests.tiny import tokens

CASES = sorted(MOE_CASES)
SCHEDULES = ("tp", "dtp:1", "dtp:2", "pt:2")
DECODE_STEPS = 6
TOL = 1e-5


@pytest.fixture(scope="module")
def moe_shards(tmp_path_factory: pytest.TempPathFactory) -> Any:
    made: dict[tuple[str, str], Path] = {}

    def make(case: str, schedule: str) -> Path:
        if (case, schedule) not in made:
            model = moe_model(case)
            layout = balanced_moe_layout(model, 2, seed=5)
            out = tmp_path_factory.mktemp(f"moe-{case}-{schedule.replace(':', '_')}") / "shards"
            export_rank_shards(permuted_copy(model, layout), layout, out, schedule=schedule)
            made[case, schedule] = out
        return made[case, schedule]

    return make


def _run(rt: DTPRuntime, shards: Path, ids: Any) -> Any:
    rt.load(shards)
    return rt.generate(ids.numpy(), max_new_tokens=DECODE_STEPS + 1, stop_at_eos=False, return_logits=True)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("case", CASES)
def test_two_ranks_match_the_simulator(runtime2: DTPRuntime, moe_shards: Any, case: str, schedule: str) -> None:
    shards = moe_shards(case, schedule)
    ids = tokens(2, 7, seed=5)
    result = _run(runtime2, shards, ids)
    prefill, steps, want = simulator_generation(shards, ids, DECODE_STEPS, schedule=schedule)
    error = max_logit_error(result, prefill, steps)
    assert error <= TOL, f"{case} {schedule}: max |Δlogit| {error:.3g}"
    np.testing.assert_array_equal(result.tokens, want.numpy())
    assert result.schedule == schedule


@pytest.mark.parametrize("case", CASES)
def test_tensor_parallelism_computes_the_dense_moe_model(runtime2: DTPRuntime, moe_shards: Any, case: str) -> None:
    """tp on the permuted shards is the original model (transformers' experts loop and cache); dtp:1 on the same
    layout is not (each rank routes its own stream, the others' partials a module late)."""
    ids = tokens(2, 7, seed=6)
    result = _run(runtime2, moe_shards(case, "tp"), ids)
    prefill, steps, want = dense_generation(moe_model(case), ids, DECODE_STEPS)
    assert max_logit_error(result, prefill, steps) <= TOL
    np.testing.assert_array_equal(result.tokens, want.numpy())
    delayed = _run(runtime2, moe_shards(case, "dtp:1"), ids)
    assert np.abs(delayed.prefill_logits - prefill.numpy()).max() > 1e-2

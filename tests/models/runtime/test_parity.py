"""The runtime's ranks compute the simulator's function: prefill logits and 8 cached decode steps within
1e-5 (fp32), the same greedy tokens; δ = 0 (tensor parallelism) computes the dense model's.

The references are independent of the runtime: the single-process simulator (`DTPModel`, itself
tested against a literal transcription of the paper's equations in tests/models/test_dtp.py) on
the model rebuilt from the same shards, and for δ = 0 the unpermuted Hugging Face model with its
own KV cache.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from models.runtime import DTPRuntime
from models.runtime.sampling import Sampling
from tests.models.runtime.reference import dense_generation, max_logit_error, simulator_generation
from tests.tiny import FAMILY_CASES, fresh, tokens

CASES = sorted(FAMILY_CASES)
DECODE_STEPS = 8
TOL = 1e-5


def run_and_compare(rt: DTPRuntime, shards_dir: Any, case: str, delta: int) -> float:
    rt.load(shards_dir)
    ids = tokens(2, 7, seed=3)
    result = rt.generate(ids.numpy(), max_new_tokens=DECODE_STEPS + 1, delta=delta, stop_at_eos=False,
                         return_logits=True)
    if delta == 0:
        prefill, steps, want = dense_generation(fresh(case), ids, DECODE_STEPS)
    else:
        prefill, steps, want = simulator_generation(shards_dir, ids, DECODE_STEPS, delta)
    error = max_logit_error(result, prefill, steps)
    assert error <= TOL, f"{case} L={rt.world_size} δ={delta}: max |Δlogit| {error:.3g}"
    np.testing.assert_array_equal(result.tokens, want.numpy())
    assert result.delta == delta and result.devices == rt.world_size
    return error


@pytest.mark.parametrize("delta", [0, 1, 2])
@pytest.mark.parametrize("case", CASES)
def test_two_ranks_match_the_simulator(runtime2: DTPRuntime, shards: Any, case: str, delta: int) -> None:
    # δ = 0 runs the δ = 1 export as tensor parallelism (the override), against the dense model.
    run_and_compare(runtime2, shards(case, 2, max(delta, 1)), case, delta)


@pytest.mark.parametrize("delta", [0, 1, 2])
@pytest.mark.parametrize("case", CASES)
def test_four_ranks_match_the_simulator(runtime4: DTPRuntime, shards: Any, case: str, delta: int) -> None:
    run_and_compare(runtime4, shards(case, 4, max(delta, 1)), case, delta)


def test_the_comparison_is_not_vacuous(runtime2: DTPRuntime, shards: Any) -> None:
    """δ = 1 differs from δ = 2 and from the dense model by far more than the tolerance, on the same shards."""
    runtime2.load(shards("qwen3", 2, 1))
    ids = tokens(1, 6, seed=4).numpy()
    logits = {d: runtime2.generate(ids, max_new_tokens=1, delta=d, return_logits=True).prefill_logits
              for d in (0, 1, 2)}
    assert np.abs(logits[1] - logits[0]).max() > 1e-2
    assert np.abs(logits[1] - logits[2]).max() > 1e-2


def test_seeded_sampling_is_reproducible_and_matches_the_simulator(runtime2: DTPRuntime, shards: Any) -> None:
    shards_dir = shards("llama", 2, 1)
    runtime2.load(shards_dir)
    ids = tokens(2, 5, seed=8)
    sampling = Sampling(temperature=1.3, top_k=40, seed=7)
    first = runtime2.generate(ids.numpy(), max_new_tokens=DECODE_STEPS + 1, temperature=1.3, top_k=40, seed=7,
                              stop_at_eos=False)
    again = runtime2.generate(ids.numpy(), max_new_tokens=DECODE_STEPS + 1, temperature=1.3, top_k=40, seed=7,
                              stop_at_eos=False)
    other = runtime2.generate(ids.numpy(), max_new_tokens=DECODE_STEPS + 1, temperature=1.3, top_k=40, seed=8,
                              stop_at_eos=False)
    np.testing.assert_array_equal(first.tokens, again.tokens)
    assert not np.array_equal(first.tokens, other.tokens)
    _, _, want = simulator_generation(shards_dir, ids, DECODE_STEPS, 1, sampling)
    np.testing.assert_array_equal(first.tokens, want.numpy())
    greedy = runtime2.generate(ids.numpy(), max_new_tokens=DECODE_STEPS + 1, stop_at_eos=False)
    assert not np.array_equal(first.tokens, greedy.tokens)  # it really sampled


def test_stops_at_eos_and_reports_timings(runtime2: DTPRuntime, shards: Any) -> None:
    runtime2.load(shards("mistral", 2, 1))
    ids = tokens(1, 6, seed=2).numpy()
    free = runtime2.generate(ids, max_new_tokens=6, stop_at_eos=False)
    eos = int(free.tokens[0, 2])  # pretend the third token is EOS
    stopped = runtime2.generate(ids, max_new_tokens=6, stop_ids=[eos])
    first_eos = list(free.tokens[0]).index(eos)
    np.testing.assert_array_equal(stopped.tokens[0], free.tokens[0, :first_eos + 1])
    assert len(free.ranks) == 2 and [r.rank for r in free.ranks] == [0, 1]
    for stats in free.ranks:
        assert stats.decode_steps == 5 and stats.ms_per_token > 0 and stats.prefill_ms > 0
        assert 0 <= stats.blocked_ms_per_token <= stats.ms_per_token
        # δ=1 over 3 layers: every module but the last is exchanged.
        assert stats.exchanges_per_token == 2 * 3 - 1


def test_bad_requests_are_refused_before_any_rank_runs(runtime2: DTPRuntime, shards: Any) -> None:
    runtime2.load(shards("llama", 2, 1))
    ids = tokens(1, 4).numpy()
    for kwargs, match in [({"delta": 4}, r"'dtp:4': δ=4 must be in 0 \.\. num_layers=3"),
                          ({"schedule": "pt:0"}, r"D \(layers per block\) must be an integer ≥ 1"),
                          ({"schedule": "tp", "delta": 0}, "give at most one of schedule"),
                          ({"max_new_tokens": 0}, "max_new_tokens must be a positive integer"),
                          ({"temperature": -1.0}, "temperature must be >= 0"),
                          ({"last_scale": "two"}, "last_scale must be 'sqrt' or 'one'"),
                          ({"link_latency_us": -5.0}, "link_latency_us must be >= 0")]:
        with pytest.raises(ValueError, match=match):
            runtime2.generate(ids, **kwargs)
    with pytest.raises(ValueError, match=r"input_ids must lie in \[0, vocab_size=97\)"):
        runtime2.generate(np.array([[5, 97]]))
    assert runtime2.alive
    assert runtime2.generate(ids, max_new_tokens=2).tokens.shape == (1, 2)


def test_link_latency_is_paid_on_every_blocking_collective(runtime2: DTPRuntime, shards: Any) -> None:
    """TP (δ=0) waits for each collective at once, so it pays the emulated latency on all of them: 2N module
    all-reduces, the reduction to rank 0 and the token broadcast per token."""
    runtime2.load(shards("llama", 2, 1))
    latency_us = 4000.0
    out = runtime2.generate(tokens(1, 4).numpy(), max_new_tokens=4, delta=0, stop_at_eos=False,
                            link_latency_us=latency_us)
    per_token = (2 * 3 + 2) * latency_us / 1e3  # ms
    for stats in out.ranks:
        assert stats.exchanges_per_token == 2 * 3
        assert stats.blocked_ms_per_token >= per_token, stats
        assert stats.ms_per_token >= stats.blocked_ms_per_token

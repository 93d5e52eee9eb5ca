"""`skip_positions`: the affinity means over each block's positions from k on. Checked through causality,
not through the code's own masking: position 0 of a block computes the same in a block of length 1, so the
all-token sums are the first position's sums (length-1 blocks) plus the skip-1 sums."""

from __future__ import annotations

import numpy as np
import pytest

from models.affinity.edges import edge_pass, schedule_affinity_pass
from models.affinity.scoring import affinity_pass
from models.schedules.grammar import resolve_schedule
from tests.tiny import tiny_model, tokens


def _sums(result, name):
    """Every matrix of the result (chain and further edges) times its token count."""
    chain = [*result.up_fo, *result.up_add, *result.down]
    edges = [np.asarray(m) for e in sorted((result.edges or {}).items()) for m in e[1].values()]
    return [np.asarray(m, dtype=np.float64) * result.tokens for m in chain + edges]


@pytest.mark.parametrize("schedule", [None, "dtp:2"])
def test_the_skipped_positions_sums_and_the_first_positions_sums_add_to_every_tokens(schedule):
    model = tiny_model("llama")
    ids = tokens(batch=3, seq=9)
    sched = None if schedule is None else resolve_schedule(schedule, 3, 2)
    whole = schedule_affinity_pass(model, ids, schedule=sched, batch_size=2)
    first = schedule_affinity_pass(model, ids[:, :1], schedule=sched, batch_size=2)
    rest = schedule_affinity_pass(model, ids, schedule=sched, batch_size=2, skip_positions=1)
    assert (whole.tokens, first.tokens, rest.tokens) == (27, 3, 24)
    for w, f, r in zip(_sums(whole, "whole"), _sums(first, "first"), _sums(rest, "rest"), strict=True):
        np.testing.assert_allclose(f + r, w, rtol=1e-5, atol=1e-9 * np.abs(w).max())
    assert not np.allclose(_sums(rest, "rest")[0], _sums(whole, "whole")[0])


@pytest.mark.parametrize("skip", [9, -1])
def test_skip_positions_is_refused_outside_the_block_by_both_passes(skip):
    model, ids = tiny_model("llama"), tokens(batch=1, seq=9)
    with pytest.raises(ValueError, match=f"skip_positions must be in \\[0, 8\\] for blocks of 9 tokens, got {skip}"):
        affinity_pass(model, ids, skip_positions=skip)
    with pytest.raises(ValueError, match=f"skip_positions must be in \\[0, 8\\] for blocks of 9 tokens, got {skip}"):
        edge_pass(model, ids, [(1, 2)], skip_positions=skip)  # called directly, not through affinity_pass

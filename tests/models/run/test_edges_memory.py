"""The pass over a schedule's edges beyond the paper's chain under the run's memory limit (issue 46): refused from
the config, before any weight is read, where it would not fit beside the model in memory
(models/affinity/edge_memory.py, models/run/rules.py `memory_refusals`). Config only: no model is built."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from transformers import Qwen3MoeConfig

from models.affinity.edge_memory import EDGE_MEMORY_LIMIT, edge_pass_memory, further_pairs
from models.families import model_shape
from models.io.sizes import format_size
from models.run.plan import plan_run
from models.run.rules import RunFacts, memory_refusals
from models.schedules.grammar import parse_schedule, resolve_schedule
from models.streaming.memory_plan import plan_memory
from tests.models.moe_kit import wide_moe_config
from tests.tiny import tiny_config

GIB = 2**30
F64 = 8


# Qwen3-30B-A3B's shape (its config.json's sizes): 48 layers, 32 query heads over 4 KV groups of 128, a 2048-wide
# residual, 128 experts of 768 neurons, 8 routed per token
QWEN3_30B_A3B: dict[str, Any] = dict(
    vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
    num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
    max_position_embeddings=40960, tie_word_embeddings=False)


def qwen3_30b_a3b() -> Qwen3MoeConfig:
    config = Qwen3MoeConfig(**QWEN3_30B_A3B)
    assert model_shape(config).head_dim == 128
    return config


def facts(schedule: str, devices: int = 4, **overrides) -> RunFacts:
    spec = parse_schedule(schedule)
    delta = spec.delta if spec.kind == "dtp" else 1
    return RunFacts(devices=devices, delta=delta, schedule=spec, dtype="bfloat16", calibration_sequences=8,
                    calibration_seq_len=512, batch_size=4, **overrides)


def in_memory_need(config, run: RunFacts) -> int:
    return plan_memory(config, dtype=run.dtype, command="optimise", limit=None,
                       tokens=run.calibration_sequences * run.calibration_seq_len,
                       batch_tokens=min(run.calibration_sequences, run.batch_size) * run.calibration_seq_len).in_memory


def test_a_qwen3_30b_a3b_shape_at_dtp2_is_refused_naming_its_need():
    config = qwen3_30b_a3b()
    run = facts("dtp:2")
    plan, refusals = memory_refusals(run, config, limit=128 * GIB)
    assert plan is not None and not plan.stream  # the model fits in memory: the edges are what does not
    assert [(r.rule, r.field) for r in refusals] == [("edges-memory", "schedule")]
    # By hand: one neuron → neuron edge of I = 128 · 768 units holds 3 [I, I] sums, an [I, E] one and its dense FO
    # and ADD [I, I] ×2, each a float64; every neuron → neuron edge has a pass of its own (each is above the 1 GiB
    # edge limit), and by the second one the finished edges kept are at the limit (one dense edge is 144 GiB).
    units, experts = 128 * 768, 128
    edge = (5 * units * units + units * experts) * F64
    need = in_memory_need(config, run) + edge + EDGE_MEMORY_LIMIT
    message = refusals[0].message
    assert message.startswith("schedule dtp:2 scores edges beyond the paper's chain")
    assert f"needs about {format_size(need)}" in message and format_size(need) == "425.64 GiB"
    assert f"one neuron → neuron edge of 98,304 × 98,304 units: {format_size(edge)}" in message
    assert "the memory limit (max_memory) is 128.00 GiB" in message
    assert "dtp:1 or dtp:1@K" in message and f"a max_memory of at least {format_size(need)}" in message
    assert str(refusals[0].exception()) == message
    # the same config under a limit it fits: no refusal
    assert memory_refusals(run, config, limit=need)[1] == []
    assert memory_refusals(run, config, limit=need - 1)[1][0].rule == "edges-memory"


@pytest.mark.parametrize("schedule", ["dtp:1", "dtp:1@8", "spd:auto:4"])
def test_a_schedule_on_the_chain_is_not_refused_for_its_edges(schedule):
    plan, refusals = memory_refusals(facts(schedule), qwen3_30b_a3b(), limit=128 * GIB)
    assert plan is not None and not plan.stream and refusals == []


def test_no_limit_and_a_streamed_run_keep_their_rules():
    config = qwen3_30b_a3b()
    assert memory_refusals(facts("dtp:2"), config, limit=None)[1] == []
    # under a limit the model does not fit in memory: streamed, refused as before (the streamed pass scores the
    # chain only), not for the in-memory edge pass
    _plan, refusals = memory_refusals(facts("dtp:2"), config, limit=32 * GIB)
    assert [r.rule for r in refusals] == ["streamed-edges"]
    # no affinity pass left to run (a cached one): nothing to refuse for the edges
    assert memory_refusals(facts("dtp:2"), config, limit=128 * GIB, affinity_pass=False)[1] == []


def test_a_tiny_moe_at_dtp2_passes_and_its_peak_is_counted_by_hand():
    config = tiny_config("qwen3_moe")  # 3 layers, 4 KV groups of 8 heads of 32, I = 8 experts × 24 = 192
    run = facts("dtp:2", devices=2)
    fits = in_memory_need(config, run) + 256 * 2**20
    plan, refusals = memory_refusals(run, config, limit=fits)
    assert plan is not None and not plan.stream and refusals == []
    # dtp:2: each module's partial reaches its own device's next-but-one module beyond the chain, attn0→attn1,
    # ffn0→ffn1, attn1→attn2, ffn1→ffn2: two KV → KV edges ([H, hd, hd] sums) and two neuron → neuron ones
    kv_kv, nn = 8 * 32 * 32 * F64, (5 * 192 * 192 + 192 * 8) * F64
    shape = model_shape(config)
    pairs = further_pairs(resolve_schedule(parse_schedule("dtp:2"), 3, 2), 3)
    assert pairs == [(0, 2), (1, 3), (2, 4), (3, 5)]
    one_pass = edge_pass_memory(pairs, shape)
    assert one_pass is not None and edge_pass_memory([], shape) is None
    assert (one_pass.rounds, one_pass.peak, one_pass.kept) == (1, 2 * kv_kv + 2 * nn, 0)
    # refused exactly above the in-memory need plus that peak
    edge_limit = in_memory_need(config, run) + one_pass.peak
    assert memory_refusals(run, config, limit=edge_limit)[1] == []
    assert [r.rule for r in memory_refusals(run, config, limit=edge_limit - 1)[1]] == ["edges-memory"]
    # an edge limit of one neuron → neuron edge: 4 passes, the finished edges kept before each (dense: a KV → KV
    # edge G·G, a neuron → neuron one FO and ADD I·I each) beside its accumulators; the last pass is the fullest
    rounds = edge_pass_memory(pairs, shape, nn)
    assert rounds is not None
    kept_before_last = (4 * 4 + 2 * 192 * 192 + 4 * 4) * F64
    assert (rounds.rounds, rounds.peak, rounds.kept) == (4, nn + kept_before_last, kept_before_last)
    assert memory_refusals(facts("dtp:1", devices=2), config, limit=in_memory_need(config, run))[1] == []


def test_the_run_plan_carries_its_edge_memory_limit():
    """The CLI's --edge-memory-limit (OptimiseSpec's) is what the rule counts the kept edges under; a job's is
    the default."""
    from app.core.schemas.jobs import JobSpec

    spec = JobSpec.model_validate({"model": {"id": "tiny"}, "devices": 2, "delta": 2,
                                   "calibration": {"source": "calib/ids.npy", "sequences": 8, "seq_len": 32}})
    assert plan_run(spec).facts.edge_memory_limit == RunFacts.of_spec(spec).edge_memory_limit == EDGE_MEMORY_LIMIT
    assert plan_run(spec, edge_memory_limit=256 * 2**20).facts.edge_memory_limit == 256 * 2**20


def test_optimise_refuses_before_reading_a_weight(tmp_path, capsys):
    """`dtp-layout optimise` on a config-only checkpoint (no weight to read): exit 2 naming the edge and the fix,
    the kept edges counted under its --edge-memory-limit."""
    from app.cli.main import main

    model = tmp_path / "wide-moe"
    wide_moe_config().save_pretrained(model)  # config.json only
    calib = tmp_path / "ids.npy"
    np.save(calib, np.random.default_rng(0).integers(0, 97, size=8 * 32))
    code = main(["optimise", str(model), "--devices", "2", "--delta", "2", "--calib", str(calib),
                 "--calib-sequences", "8", "--calib-seq-len", "32", "--max-memory", "4GiB", "--out",
                 str(tmp_path / "run"), "--device", "cpu", "--edge-memory-limit", str(256 * 2**20)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "schedule dtp:2 scores edges beyond the paper's chain" in err and "98,304 × 98,304 units" in err
    assert f"finished edges kept {format_size(256 * 2**20)}" in err
    assert "the memory limit (max_memory) is 4.00 GiB" in err
    assert not (tmp_path / "run").exists()

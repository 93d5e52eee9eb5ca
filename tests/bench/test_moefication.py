"""bench/moefication.py: the dense-to-Mixtral conversion (issue 46's evidence model) on tiny random llamas, fp32.

Each check is against something written out here independently: the dense model itself (k = E), the MoEfication
sum of the chosen experts' neurons computed from the dense weights (k < E), planted clusters and a brute-force
balanced assignment, and a router whose targets are exactly linear.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from bench import moefication as mf
from tests.tiny import tiny_model, tokens

EXPERTS = 4  # the tiny FFN's 96 neurons: 4 experts of 24


@pytest.fixture(scope="module", params=["llama", "llama-tied-headdim"])
def converted(request):
    model = tiny_model(request.param)
    calibration = tokens(4, 32, seed=3)
    return model, calibration, mf.convert(model, calibration, experts=EXPERTS, iters=10)


def test_with_every_expert_active_the_moe_is_the_dense_model(converted, tmp_path):
    model, _, conversion = converted
    moe = mf.to_mixtral(model, conversion, top_k=EXPERTS)
    assert type(moe).__name__ == "MixtralForCausalLM"
    assert moe.config.num_local_experts == EXPERTS and moe.config.intermediate_size == 96 // EXPERTS
    ids = tokens(2, 12, seed=9)
    with torch.no_grad():
        dense = model(ids).logits
        torch.testing.assert_close(moe(ids).logits, dense)
    mf.save(moe, None, conversion, tmp_path / "moe")  # safetensors + config, read back by transformers alone
    from transformers import AutoModelForCausalLM

    back = AutoModelForCausalLM.from_pretrained(tmp_path / "moe", dtype=torch.float32, use_safetensors=True).eval()
    assert sorted(p.name for p in (tmp_path / "moe").glob("*.safetensors")) == ["model.safetensors"]
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, dense)


def test_the_experts_partition_the_neurons_in_equal_ascending_groups(converted):
    _, _, conversion = converted
    for split in conversion.layers:
        assert split.experts.shape == (EXPERTS, 96 // EXPERTS)
        assert sorted(split.experts.flatten().tolist()) == list(range(96))
        assert all(torch.all(row[1:] > row[:-1]) for row in split.experts)


@pytest.mark.parametrize("top_k", [1, 2])
def test_with_k_experts_each_ffn_is_moefications_sum_of_the_chosen_experts(converted, top_k):
    """On the calibration tokens (whose router logit spread is at most GATE_SPREAD), each Mixtral block equals
    Σ over the k experts with the highest router scores of Σ_{j ∈ e} h_j · down[:, j], from the dense weights,
    within the renormalised gate's deviation from 1/k: |k·w − 1| ≤ e^spread − 1."""
    model, calibration, conversion = converted
    moe = mf.to_mixtral(model, conversion, top_k=top_k)
    inputs = mf.ffn_inputs(model, calibration)
    for i, (x, split) in enumerate(zip(inputs, conversion.layers, strict=True)):
        dense_mlp = model.model.layers[i].mlp
        gate, up, down = dense_mlp.gate_proj.weight, dense_mlp.up_proj.weight, dense_mlp.down_proj.weight
        with torch.no_grad():
            got = moe.model.layers[i].mlp(x[None])[0]  # [T, D]
        scores = x @ split.router.T  # [T, E]
        for t in range(0, x.shape[0], 7):
            chosen = scores[t].topk(top_k).indices
            parts = []
            for e in chosen.tolist():
                neurons = split.experts[e]
                h = F.silu(x[t] @ gate[neurons].T) * (x[t] @ up[neurons].T)  # [I_e]
                parts.append(down[:, neurons] @ h)  # [D]
            want = torch.stack(parts).sum(0)
            bound = (math.exp(mf.GATE_SPREAD) - 1) * torch.stack(parts).abs().sum(0) + 1e-5
            assert torch.all((got[t] - want).abs() <= bound), (i, t)


def test_fewer_experts_per_token_move_the_model_further_from_the_dense_one(converted):
    model, _, conversion = converted
    held = tokens(2, 24, seed=11)
    moe = mf.to_mixtral(model, conversion, top_k=2)
    kl = mf.kl_to_dense(model, moe, held, conversion=conversion, top_ks=[1, 2, EXPERTS])
    assert kl[1] > kl[2] > 0.0 and abs(kl[EXPERTS]) < 1e-6
    assert mf.kl_to_dense(model, mf.to_mixtral(model, conversion, top_k=1), held) == {1: pytest.approx(kl[1])}


def test_switching_k_in_place_is_the_model_converted_with_that_k(converted):
    model, _, conversion = converted
    ids = tokens(2, 12, seed=13)
    moe = mf.to_mixtral(model, conversion, top_k=EXPERTS)
    with torch.no_grad():
        for k in (1, 2, EXPERTS):
            torch.testing.assert_close(mf.set_top_k(moe, conversion, k)(ids).logits,
                                       mf.to_mixtral(model, conversion, top_k=k)(ids).logits)


# ---- the clusters ------------------------------------------------------------------------------------------------

def test_balanced_assignment_is_the_brute_force_optimum():
    rng = np.random.default_rng(0)
    for _ in range(5):
        cost = rng.normal(size=(6, 3))
        best = min(sum(cost[n, lab] for n, lab in enumerate(labels))
                   for labels in itertools.product(range(3), repeat=6) if all(labels.count(c) == 2 for c in range(3)))
        labels = mf.balanced_assign(cost, 2)
        assert np.bincount(labels, minlength=3).tolist() == [2, 2, 2]
        assert sum(cost[n, lab] for n, lab in enumerate(labels)) == pytest.approx(best)


def planted(sizes: list[int], dims: int = 40, noise: float = 0.3, seed: int = 0) -> tuple[torch.Tensor, list[int]]:
    """Items around one non-negative prototype per group (activation patterns), shuffled: (features, group)."""
    g = torch.Generator().manual_seed(seed)
    protos = torch.rand(len(sizes), dims, generator=g) ** 4  # sparse-ish, like |h| patterns
    group = [k for k, n in enumerate(sizes) for _ in range(n)]
    order = torch.randperm(len(group), generator=g).tolist()
    group = [group[o] for o in order]
    feats = torch.stack([protos[k] + noise * protos.mean() * torch.rand(dims, generator=g) for k in group])
    return feats, group


def test_balanced_kmeans_recovers_planted_co_activation_groups():
    feats, group = planted([6, 6, 6, 6])
    labels = mf.balanced_kmeans(feats, 4, seed=1)
    assert torch.bincount(labels).tolist() == [6, 6, 6, 6]
    pairs = {(g, int(lab)) for g, lab in zip(group, labels, strict=True)}
    assert len(pairs) == 4  # each planted group is one cluster


def test_balanced_kmeans_keeps_clusters_equal_when_the_data_are_not():
    feats, group = planted([12, 6, 4, 2])
    labels = mf.balanced_kmeans(feats, 4, seed=0)
    assert torch.bincount(labels).tolist() == [6, 6, 6, 6]
    big = {int(lab) for g, lab in zip(group, labels, strict=True) if g == 0}
    assert len(big) == 2  # the group of 12 fills two whole clusters
    assert {g for g, lab in zip(group, labels, strict=True) if int(lab) in big} == {0}


def test_an_uneven_split_is_refused_naming_the_field():
    with pytest.raises(mf.ConversionError, match="experts"):
        mf.balanced_kmeans(torch.rand(10, 3), 4)
    with pytest.raises(mf.ConversionError, match="experts: 96 FFN neurons"):
        mf.convert(tiny_model("llama"), tokens(1, 8), experts=5)
    with pytest.raises(mf.ConversionError, match="model_type 'qwen3'"):
        mf.convert(tiny_model("qwen3"), tokens(1, 8), experts=4)
    with pytest.raises(mf.ConversionError, match="top_k"):
        mf.mixtral_config(tiny_model("llama").config, experts=4, top_k=5)


# ---- the router --------------------------------------------------------------------------------------------------

def test_a_router_fit_to_exactly_linear_masses_recovers_their_order():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(400, 16, generator=g)
    truth = torch.randn(6, 16, generator=g)
    offset = 5.0 * torch.randn(400, 1, generator=g)  # a per-token shift changes no token's order
    mass = x @ truth.T + offset
    weight = mf.fit_router(x, mass, ridge=0.0)
    assert torch.allclose(weight.float(), truth - truth.mean(0), atol=1e-4)
    scores = x.double() @ weight.T
    for k in (1, 2, 3):
        assert mf.mass_recall(scores, mass.double() - mass.double().min(), k) == pytest.approx(1.0)


def test_the_router_fit_is_ridge_least_squares():
    """Against numpy's least squares on the augmented system [x; √λ·I] (the slow transcription of the ridge)."""
    g = torch.Generator().manual_seed(1)
    x, mass = torch.randn(50, 8, generator=g), torch.rand(50, 3, generator=g)
    weight = mf.fit_router(x, mass, ridge=0.1)
    xs, m = x.double().numpy(), mass.double().numpy()
    target = m - m.mean(axis=1, keepdims=True)
    lam = 0.1 * float(np.mean(np.diag(xs.T @ xs)))
    aug_x = np.vstack([xs, math.sqrt(lam) * np.eye(8)])
    aug_y = np.vstack([target, np.zeros((8, 3))])
    want = np.linalg.lstsq(aug_x, aug_y, rcond=None)[0].T
    np.testing.assert_allclose(weight.numpy(), want, rtol=1e-8, atol=1e-10)


def test_the_flattened_router_keeps_the_order_within_the_spread():
    g = torch.Generator().manual_seed(2)
    x, weight = torch.randn(30, 8, generator=g), torch.randn(5, 8, generator=g)
    flat = mf.flattened(weight, x)
    before, after = x @ weight.T, x @ flat.T
    assert torch.equal(before.argsort(dim=1), after.argsort(dim=1))
    assert float((after.max(1).values - after.min(1).values).max()) == pytest.approx(mf.GATE_SPREAD, rel=1e-5)


def test_the_greedy_step_is_balanced_and_never_beats_the_exact_one():
    rng = np.random.default_rng(3)
    for _ in range(5):
        cost = rng.normal(size=(12, 4))
        greedy, exact = mf.greedy_balanced_assign(cost, 3), mf.balanced_assign(cost, 3)
        assert np.bincount(greedy, minlength=4).tolist() == [3, 3, 3, 3]
        assert cost[np.arange(12), greedy].sum() >= cost[np.arange(12), exact].sum() - 1e-12

"""The edge scores of docs/schedules_objective.md against finite differences on a tiny dense model.

One construction covers every edge a schedule adds (docs/schedules_objective.md): a sending unit writes
d_t into the residual stream (head h: W_o^(h) a_h,t; neuron k: α_k,t w^d_k); the receiving unit reads
the stream x_t through its module's pre-norm (γ, r = rms(x_t)). With p = γ ⊙ d / r:

    receiving KV group g:   Δ = W^qkv_g p                                 S = E_t ‖Δ‖²
    receiving neuron k:     Δ = silu'(g_k) u_k (p·w^g_k) + silu(g_k) (p·w^u_k)   S_FO = E_t[Δ²] ‖w^d_k‖²
                            S_ADD = E_t[(p·w^g_k)² + (p·w^u_k)²]

Δ is the first-order change of the receiving unit's pre-activations (group) or activation (neuron) when
the sender's write is removed from its input, with the norm's rms held (as the paper's scores do). The
checks: Δ equals the central finite difference with r held (to 1e-8, fp64); with r free the difference is
exactly the rms term the scores neglect; and for the paper's two edge kinds (head → same-layer neuron,
neuron → next-layer group) the construction reproduces `models.affinity.scoring`'s up FO, up ADD and down scores.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.numpy import save_file

from models.affinity.edges import schedule_affinity_pass
from models.affinity.scoring import affinity_pass
from models.families import model_shape
from tests.tiny import fresh, tokens

EPS_FD = 1e-5


def dense_trace(model: Any, ids: torch.Tensor) -> dict[str, list[torch.Tensor]]:
    """Per layer: the stream entering attention ('x_attn') and the FFN ('x_ffn'), heads before o_proj
    ('heads', [T, H*hd]) and the FFN activations ('act', [T, I]), flattened over tokens."""
    layers = model.model.layers
    seen: dict[str, list[torch.Tensor]] = {k: [None] * len(layers) for k in ("x_attn", "x_ffn", "heads", "act")}

    def keep(name: str, i: int) -> Any:
        def hook(_mod: Any, args: tuple[Any, ...]) -> None:
            seen[name][i] = args[0].detach().reshape(-1, args[0].shape[-1]).clone()
        return hook

    handles = []
    for i, layer in enumerate(layers):
        handles += [layer.input_layernorm.register_forward_pre_hook(keep("x_attn", i)),
                    layer.post_attention_layernorm.register_forward_pre_hook(keep("x_ffn", i)),
                    layer.self_attn.o_proj.register_forward_pre_hook(keep("heads", i)),
                    layer.mlp.down_proj.register_forward_pre_hook(keep("act", i))]
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for h in handles:
            h.remove()
    return seen


def head_writes(model: Any, trace: dict, i: int) -> torch.Tensor:
    """d_h,t = W_o^(h) a_h,t for every query head of attention i: [H, T, D]."""
    shape = model_shape(model.config)
    a = trace["heads"][i].view(-1, shape.num_query_heads, shape.head_dim).transpose(0, 1)  # [H, T, hd]
    w_o = model.model.layers[i].self_attn.o_proj.weight.view(-1, shape.num_query_heads, shape.head_dim)  # [D, H, hd]
    return torch.einsum("htc,dhc->htd", a, w_o)


def neuron_writes(model: Any, trace: dict, i: int) -> torch.Tensor:
    """d_k,t = α_k,t w^d_k for every neuron of FFN i: [I, T, D]."""
    return trace["act"][i].t()[:, :, None] * model.model.layers[i].mlp.down_proj.weight.t()[:, None, :]


# ---- the receivers: the exact function of the input, and the first-order Δ of the doc -----------------

def group_preacts(model: Any, j: int, x: torch.Tensor, r: torch.Tensor | None = None) -> torch.Tensor:
    """q/k/v pre-activations of every KV group of attention j from stream x [..., T, D]: [..., T, G, c]
    (r: the rms to use, None: x's own)."""
    shape = model_shape(model.config)
    layer = model.model.layers[j]
    r = x.pow(2).mean(-1, keepdim=True).sqrt() if r is None else r  # eps (1e-6) dropped on both sides
    h = layer.input_layernorm.weight * x / r
    attn = layer.self_attn
    G = shape.num_kv_groups
    q = (h @ attn.q_proj.weight.t()).unflatten(-1, (G, -1))
    k = (h @ attn.k_proj.weight.t()).unflatten(-1, (G, -1))
    v = (h @ attn.v_proj.weight.t()).unflatten(-1, (G, -1))
    return torch.cat([q, k, v], dim=-1)


def neuron_acts(model: Any, j: int, x: torch.Tensor, r: torch.Tensor | None = None) -> torch.Tensor:
    """silu(g) u of every neuron of FFN j from stream x [..., T, D]: [..., T, I]."""
    layer = model.model.layers[j]
    r = x.pow(2).mean(-1, keepdim=True).sqrt() if r is None else r
    h = layer.post_attention_layernorm.weight * x / r
    return F.silu(h @ layer.mlp.gate_proj.weight.t()) * (h @ layer.mlp.up_proj.weight.t())


def first_order(model: Any, kind: str, j: int, x: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """The doc's Δ for senders d [U, T, D] into receiver module (kind, j) at stream x [T, D]:
    [U, T, G, c] (groups) or [U, T, I] (neurons)."""
    layer = model.model.layers[j]
    r = x.pow(2).mean(-1, keepdim=True).sqrt()  # [T, 1]
    if kind == "attn":
        p = layer.input_layernorm.weight * d / r
        attn = layer.self_attn
        G = model_shape(model.config).num_kv_groups
        return torch.cat([(p @ w.weight.t()).unflatten(-1, (G, -1)) for w in (attn.q_proj, attn.k_proj, attn.v_proj)],
                         dim=-1)
    p = layer.post_attention_layernorm.weight * d / r
    h = layer.post_attention_layernorm.weight * x / r
    g, u = h @ layer.mlp.gate_proj.weight.t(), h @ layer.mlp.up_proj.weight.t()  # [T, I]
    sig = torch.sigmoid(g)
    dsilu = sig * (1 + g * (1 - sig))
    return dsilu * u * (p @ layer.mlp.gate_proj.weight.t()) + F.silu(g) * (p @ layer.mlp.up_proj.weight.t())


# The four sender → receiver kinds, with the schedule that first makes each an edge of J_σ.
EDGES = [
    ("head", 0, "ffn", 0),   # up: every schedule with a lag (dtp:1)
    ("neuron", 0, "attn", 1),  # down (dtp:1)
    ("head", 0, "attn", 1),  # KV → KV, consecutive attentions (dtp:2, pt:D, spd at layer 0 and ...)
    ("neuron", 0, "ffn", 1),  # neuron → neuron, consecutive FFNs (dtp:2, pt:D with D ≥ 2)
    ("head", 0, "ffn", 1),   # head → next layer's neurons (dtp:3, pt:D with D ≥ 2)
]


@pytest.fixture(scope="module")
def setup() -> tuple[Any, dict]:
    model = fresh("qwen2").double()  # q/k/v biases: the receiver's bias cancels in Δ
    return model, dense_trace(model, tokens(2, 7))


@pytest.mark.parametrize(("sender", "i", "receiver", "j"), EDGES)
def test_first_order_effect_is_the_derivative_with_rms_held(setup: tuple, sender: str, i: int, receiver: str,
                                                         j: int) -> None:
    model, trace = setup
    d = (head_writes if sender == "head" else neuron_writes)(model, trace, i)  # [U, T, D]
    x = trace["x_attn" if receiver == "attn" else "x_ffn"][j]  # [T, D]
    f = group_preacts if receiver == "attn" else neuron_acts
    r = x.pow(2).mean(-1, keepdim=True).sqrt()
    with torch.no_grad():
        delta = first_order(model, receiver, j, x, d)
        held = (f(model, j, x + EPS_FD * d, r) - f(model, j, x - EPS_FD * d, r)) / (2 * EPS_FD)
        free = (f(model, j, x + EPS_FD * d) - f(model, j, x - EPS_FD * d)) / (2 * EPS_FD)
        # The rms term the scores neglect: ∂(1/r) along d = -(x·d)/(D r³), i.e. the input direction
        # -x (x·d)/(D r²), whose first-order effect is Δ of that direction.
        rms_dir = -x * ((x * d).sum(-1, keepdim=True) / (x.shape[-1] * r.square()))  # [U, T, D]
        rms_term = first_order(model, receiver, j, x, rms_dir)
    scale = held.abs().max()
    assert scale > 1e-3  # the edge is not empty
    torch.testing.assert_close(delta, held, atol=1e-8 * float(scale), rtol=1e-7)
    torch.testing.assert_close(delta + rms_term, free, atol=1e-8 * float(scale), rtol=1e-7)
    assert (delta - free).abs().max() > 1e-6 * scale  # and the rms term is not nothing


def test_paper_edges_are_models_affinity_scores() -> None:
    """The construction at the paper's two edge kinds gives models.affinity.scoring's up FO, up ADD and down."""
    model = fresh("qwen2").double()
    ids = tokens(2, 7)
    trace = dense_trace(model, ids)
    shape = model_shape(model.config)
    T, per_group = ids.numel(), shape.heads_per_group
    result = affinity_pass(model, ids, batch_size=2)
    with torch.no_grad():
        for i in range(shape.num_layers):
            layer = model.model.layers[i]
            x = trace["x_ffn"][i]
            d = head_writes(model, trace, i)
            delta = first_order(model, "ffn", i, x, d)  # [H, T, I]
            fo = delta.square().sum(1) / T * layer.mlp.down_proj.weight.square().sum(0)  # [H, I]
            r = x.pow(2).mean(-1, keepdim=True).sqrt()
            p = layer.post_attention_layernorm.weight * d / r
            mlp = layer.mlp
            add = ((p @ mlp.gate_proj.weight.t()).square() + (p @ mlp.up_proj.weight.t()).square()).sum(1) / T
            np.testing.assert_allclose(fo.view(shape.num_kv_groups, per_group, -1).sum(1).numpy(), result.up_fo[i],
                                       rtol=1e-4, atol=1e-10)
            np.testing.assert_allclose(add.view(shape.num_kv_groups, per_group, -1).sum(1).numpy(),
                                       result.up_add[i], rtol=1e-4, atol=1e-10)
            if i + 1 < shape.num_layers:
                down = first_order(model, "attn", i + 1, trace["x_attn"][i + 1], neuron_writes(model, trace, i))
                score = down.square().sum((1, 3)) / T  # [I, G]
                np.testing.assert_allclose(score.numpy(), result.down[i], rtol=1e-4, atol=1e-10)


def construction_scores(model: Any, trace: dict, m: int, t: int) -> dict[str, np.ndarray]:
    """The doc's FO and ADD scores of edge (m, t) from the finite-difference-checked Δ above: [U_m, U_t]."""
    shape = model_shape(model.config)
    T = trace["x_attn"][0].shape[0]
    i, j = m // 2, t // 2
    d = head_writes(model, trace, i) if m % 2 == 0 else neuron_writes(model, trace, i)  # [U, T, D]
    if t % 2 == 0:
        delta = first_order(model, "attn", j, trace["x_attn"][j], d)  # [U, T, G, c]
        fo = add = delta.square().sum((1, 3)) / T
    else:
        layer = model.model.layers[j]
        x = trace["x_ffn"][j]
        delta = first_order(model, "ffn", j, x, d)  # [U, T, I]
        fo = delta.square().sum(1) / T * layer.mlp.down_proj.weight.square().sum(0)
        p = layer.post_attention_layernorm.weight * d / x.pow(2).mean(-1, keepdim=True).sqrt()
        add = ((p @ layer.mlp.gate_proj.weight.t()).square() + (p @ layer.mlp.up_proj.weight.t()).square()).sum(1) / T
    if m % 2 == 0:  # a KV group's score is the sum of its query heads'
        fo = fo.view(shape.num_kv_groups, shape.heads_per_group, -1).sum(1)
        add = add.view(shape.num_kv_groups, shape.heads_per_group, -1).sum(1)
    return {"fo": fo.numpy(), "add": add.numpy()}


def test_schedule_edges_of_the_pass_are_the_constructions_scores() -> None:
    """pt:3 on the 3-layer model joins every pair of modules: each further edge the pass scores equals the
    construction (the paper's chain edges are checked above)."""
    from models.schedules.grammar import resolve_schedule

    model = fresh("qwen2").double()
    ids = tokens(2, 7)
    trace = dense_trace(model, ids)
    schedule = resolve_schedule("pt:3", 3, 2)
    result = schedule_affinity_pass(model, ids, batch_size=1, schedule=schedule)
    assert result.schedule == "pt:3"
    kinds = set()
    for (m, t), scores in result.edges.items():
        assert t > m + 1
        kinds.add((m % 2, t % 2))
        with torch.no_grad():
            expected = construction_scores(model, trace, m, t)
        for name in ("fo", "add"):
            np.testing.assert_allclose(scores[name], expected[name], rtol=1e-4, atol=1e-12)
    assert kinds == {(0, 0), (0, 1), (1, 0), (1, 1)}
    assert len(result.edges) == 15 - 5  # every pair of the 6 modules but the chain's


def test_dtp1_pass_is_todays_and_files_round_trip(tmp_path: Any) -> None:
    from models.affinity.edge_memory import dense_edge_bytes
    from models.affinity.edges import SPARSE_ENTRY
    from models.affinity.file import AffinityResult
    from models.families import model_shape
    from models.optimise.edges import SparseEdge
    from models.schedules.grammar import resolve_schedule

    model = fresh("llama")
    ids = tokens(2, 9)
    today = affinity_pass(model, ids, batch_size=1)
    at_dtp1 = schedule_affinity_pass(model, ids, batch_size=1, schedule=resolve_schedule("dtp:1", 3, 2))
    assert at_dtp1.edges == {} and at_dtp1.schedule == "dtp:1"
    for a, b in zip([*today.up_fo, *today.up_add, *today.down], [*at_dtp1.up_fo, *at_dtp1.up_add, *at_dtp1.down],
                    strict=True):
        np.testing.assert_array_equal(a, b)
    dtp2 = resolve_schedule("dtp:2", 3, 2)
    dense = schedule_affinity_pass(model, ids, batch_size=1, schedule=dtp2)
    further = sum(dense_edge_bytes(p, model_shape(model.config)) for p in dense.edges)
    # One byte short of dense: the neuron → neuron matrices are cut, with room for 95 % of their mass
    # (a matrix whose 95 % takes more entries than half of it stays dense: that is smaller).
    roomy = schedule_affinity_pass(model, ids, batch_size=1, schedule=dtp2, edge_memory_limit=further - 1)
    nn = [p for p in roomy.edges if p[0] % 2 and p[1] % 2]
    assert nn and all(getattr(roomy.edges[p][name], "kept_mass", 1.0) >= 0.95 for p in nn for name in ("fo", "add"))
    sparse = schedule_affinity_pass(model, ids, batch_size=1, schedule=dtp2, edge_memory_limit=further - 1,
                                    edge_kept_mass=0.5)
    assert all(isinstance(sparse.edges[p][name], SparseEdge) for p in nn for name in ("fo", "add"))
    for p in nn:
        for name in ("fo", "add"):
            kept, full = sparse.edges[p][name], dense.edges[p][name]
            dropped = full.copy()
            dropped[kept.rows, kept.cols] = -1.0  # literally: what was not kept
            assert kept.values.min() >= dropped.max()  # the largest entries
            np.testing.assert_allclose(kept.values, full[kept.rows, kept.cols], rtol=1e-12)
            assert kept.total == pytest.approx(full.sum(), rel=1e-12)
            assert kept.kept_mass >= 0.5 > kept.kept_mass - kept.values.min() / kept.total  # the fewest
    tight = further // 3  # too little for 95 %: the limit holds and the kept mass says what it cost
    cut = schedule_affinity_pass(model, ids, batch_size=1, schedule=dtp2, edge_memory_limit=tight)
    held = {id(m): m for scores in cut.edges.values() for m in scores.values()}  # FO is ADD into a KV group
    stored = sum(m.values.size * SPARSE_ENTRY if isinstance(m, SparseEdge) else m.nbytes for m in held.values())
    assert stored <= tight and min(cut.edges[p]["fo"].kept_mass for p in nn) < 0.95
    sparse.save(tmp_path / "a.safetensors")
    back = AffinityResult.load(tmp_path / "a.safetensors")
    assert back.schedule == "dtp:2" and sorted(back.edges) == sorted(sparse.edges)
    for p, scores in sparse.edges.items():
        for name, matrix in scores.items():
            got = back.edges[p][name]
            if isinstance(matrix, SparseEdge):
                for part in ("rows", "cols", "values"):
                    np.testing.assert_array_equal(getattr(got, part), getattr(matrix, part))
                assert got.total == matrix.total and got.shape == matrix.shape
            else:
                np.testing.assert_array_equal(got, matrix)
    today.save(tmp_path / "new.safetensors")  # a file from before schedules (no schedule/edges metadata)
    with safe_open(str(tmp_path / "new.safetensors"), framework="np") as f:
        meta = {k: v for k, v in (f.metadata() or {}).items() if k not in ("schedule", "edges")}
        save_file({k: f.get_tensor(k) for k in f.keys()}, str(tmp_path / "old.safetensors"), metadata=meta)  # noqa: SIM118
    old = AffinityResult.load(tmp_path / "old.safetensors")  # reads as dtp:1 and refuses dtp:2
    assert old.schedule == "dtp:1" and old.edges == {}
    with pytest.raises(ValueError, match="rerun the affinity pass with schedule dtp:2"):
        old.schedule_affinity("fo", dtp2)
    assert back.schedule_affinity("add", resolve_schedule("dtp:1", 3, 2)).edges.keys() == set(
        old.schedule_affinity("add", resolve_schedule("dtp:1", 3, 2)).edges)


def test_edge_pass_in_rounds_keeps_its_accumulators_under_the_limit_and_the_same_scores() -> None:
    """A limit that fits the dense edges but not every accumulator at once: several passes over the blocks,
    each within the limit (an edge alone excepted), and every score equal to the single pass's."""
    from models.affinity.edge_memory import accumulator_bytes, dense_edge_bytes, edge_rounds
    from models.affinity.edges import edge_pass
    from models.affinity.file import AffinityResult
    from models.schedules.grammar import resolve_schedule

    model = fresh("llama")
    shape = model_shape(model.config)
    ids = tokens(2, 9)
    pairs = sorted(AffinityResult.missing_edges_of(shape, resolve_schedule("pt:3", 3, 2)))
    dense_total = sum(dense_edge_bytes(p, shape) for p in pairs)
    # room for every finished edge (nothing is cut to top-k) but not for every accumulator at once
    limit = max(dense_total, 2 * max(accumulator_bytes(p, shape) for p in pairs))
    assert limit < sum(accumulator_bytes(p, shape) for p in pairs)
    rounds = edge_rounds(pairs, shape, limit)
    assert len(rounds) > 1 and [p for r in rounds for p in r] == pairs
    assert all(sum(accumulator_bytes(p, shape) for p in r) <= limit for r in rounds)
    seen: list[float] = []
    one = edge_pass(model, ids, pairs, batch_size=1, memory_limit=1 << 40)
    split = edge_pass(model, ids, pairs, batch_size=1, memory_limit=limit, progress=lambda _stage, f: seen.append(f))
    assert seen == sorted(seen) and seen[-1] == pytest.approx(1.0)
    assert sorted(split) == sorted(one)
    for p in pairs:
        for name in ("fo", "add"):
            np.testing.assert_array_equal(split[p][name], one[p][name])  # same sums, same order: bit-equal

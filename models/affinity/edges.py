"""The affinity scores of the edges a schedule adds beyond the paper's chain (issue 20).

docs/schedules_objective.md derives them: the first-order effect on a receiving unit of module t of
removing a sending unit of module m's write from its input, read through t's pre-norm (γ_t, and the
rms r of the dense stream entering t, held). With a sending head h of attention i writing
d = W_o^(h) a_h, a sending neuron k' of FFN i writing d = α_k' w^d_k', and p = γ_t ⊙ d / r:

    → KV group g of attention j:  S = E_t ‖W^qkv_g p‖²                     (one score: FO = ADD)
          head h:   tr(F_hg C_h F_hgᵀ), F_hg = W^qkv_g diag(γ) W_o^(h), C_h = E_t[a_h a_hᵀ / r²]
          neuron k': E_t[α_k'² / r²] ‖W^qkv_g (γ ⊙ w^d_k')‖²               (the paper's down score)
    → neuron k of FFN j:  Δ = silu'(g_k) u_k (p·w^g_k) + silu(g_k) (p·w^u_k)
          FO  = E_t[Δ²] ‖w^d_k‖²,   ADD = E_t[(p·w^g_k)² + (p·w^u_k)²]
          head h:   as the paper's up score, with h's o_proj folded into FFN j's gate/up weights
          neuron k': p·w_k = β_k' M[k', k], β = α_k'/r, M = W_dᵀ diag(γ) W_(g|u)ᵀ [I, I], so
                    FO = (Mg² ⊙ E[β²A²] + 2 Mg⊙Mu ⊙ E[β²AB] + Mu² ⊙ E[β²B²]) · ‖w^d_k‖²
                    (A = silu'(g)u, B = silu(g) of the receiver; E[β²A²] = (β²)ᵀA² / T: [I, I])
                    ADD = E[β²] (Mg² + Mu²)

A head's scores are summed over the heads of its KV group, as the paper does. One no-grad dense
forward per micro-batch; a sender's writes are kept only until its last receiver has read them.

A mixture-of-experts FFN's units are its experts' neurons (`models.affinity.units`, as in the chain pass): unit
u of expert e writes w_e(t) α_u(t) w^d_u, w_e(t) token t's router gate weight of e (0 where t does not reach e),
so as a sender its α is w_e α_u, and as a receiver its Δ and both its ADD terms are scaled by the receiving
token's w_e(t) (FO and ADD by w_e²), the routing (the router's choice and weights) held as the rms is. The
neuron → neuron ADD then reads E[β_k'² w_e(k)²] per sending neuron and receiving expert ([I, E]), the FO the
weighted A = w silu'(g)u and B = w silu(g). With every weight 1 these are the dense scores above.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from models.affinity.edge_memory import EDGE_MEMORY_LIMIT, dense_edge_bytes, edge_rounds, further_pairs
from models.affinity.names import SCORES
from models.affinity.scoring import (
    NEURON_BLOCK,
    AffinityResult,
    LayerAccumulator,
    _accumulate_up,
    _down_weight_norms,
    _fold,
    _rms_inverse,
    affinity_pass,
    check_skip_positions,
    counted,
    counted_tokens,
    sum_dtype,
)
from models.affinity.units import ffn_units
from models.base.progress import Cancelled, Progress, ShouldStop
from models.base.shapes import ModelShape
from models.families import model_shape
from models.optimise.edges import EdgeMatrix, Pair, SparseEdge, edge_kind
from models.schedules.grammar import Schedule
from models.sim.dtp import DTPModel, rms_norm
from models.sim.moe import Routing
from models.sim.permute import decoder_layers
from models.streaming.source import layer_source

EdgeScores = dict[str, EdgeMatrix]  # {"fo": [U_m, U_t], "add": [U_m, U_t]}


class _EdgeAccumulator:
    """float64 sums over tokens for one edge (m, t), by kind."""

    def __init__(self, pair: Pair, shape: ModelShape, device: torch.device) -> None:
        H, hd, I = shape.num_query_heads, shape.head_dim, shape.intermediate_size
        self.kind = edge_kind(pair)

        def zeros(*size: int) -> torch.Tensor:
            return torch.zeros(*size, dtype=torch.float64, device=device)

        if self.kind == "up":  # head → later FFN
            self.layer = LayerAccumulator(H, I, device)
        elif self.kind == "down":  # neuron → later attention: Σ α²/r²
            self.act = zeros(I)
        elif self.kind == "kv-kv":  # Σ (a_h/r)(a_h/r)ᵀ
            self.cov = zeros(H, hd, hd)
        else:  # neuron → neuron: E[β²A²], E[β²AB], E[β²B²] [I, I] and E[β² w_e²] [I, E] (dense: E = 1, w = 1)
            self.aa = zeros(I, I)
            self.ab = zeros(I, I)
            self.bb = zeros(I, I)
            self.beta = zeros(I, shape.neuron_blocks)


def _receiver_ffn(layer: Any, x: torch.Tensor, eps: float, routing: Routing | None) -> dict[str, Any]:
    """What a receiving FFN's units read: inv_r [T, 1], gate/up [T, I], its units (`FfnUnits`), each token's
    weight of each unit ("weight" [T, I], and per expert "expert_weight" [T, E]; None: a dense FFN, all 1),
    A = w silu'(g)u and B = w silu(g) (w the weight: the units' terms as they reach the residual), and the
    units' write ("act" [T, I]: w α)."""
    units = ffn_units(layer, routing)
    normed = rms_norm(x, layer.post_attention_layernorm.weight, eps)
    gate = normed @ units.gate.t()  # [T, I]
    up = normed @ units.up.t()
    weight = units.token_weights(normed)  # [T, I] or None
    sig = torch.sigmoid(gate)
    reads: dict[str, Any] = {"inv_r": _rms_inverse(x, eps), "gate": gate, "up": up, "units": units,
                             "weight": weight, "expert_weight": None, "A": sig * (1 + gate * (1 - sig)) * up,
                             "B": gate * sig, "act": F.silu(gate) * up}
    if weight is not None:
        reads["expert_weight"] = weight[:, :: gate.shape[1] // units.experts]  # [T, E]: its first unit's
        for name in ("A", "B", "act"):
            reads[name] = reads[name] * weight
    return reads


def _accumulate(acc: _EdgeAccumulator, pair: Pair, write: torch.Tensor, receiver: dict[str, Any],
                layers: Any, shape: ModelShape, token_chunk: int) -> None:
    """write: the sender's heads_out [T, H*hd] or its units' writes w α [T, I]; receiver: its read state."""
    inv_r = receiver["inv_r"]  # [T, 1]
    acc_dtype = sum_dtype(write.dtype)
    if acc.kind == "up":
        fold = _fold(layers[pair[0] // 2], receiver["units"], shape.num_query_heads, shape.head_dim, NEURON_BLOCK,
                     receiver=layers[pair[1] // 2])
        _accumulate_up(acc.layer, write, inv_r, receiver["gate"], receiver["up"], fold, token_chunk,
                       receiver["weight"])
    elif acc.kind == "down":
        acc.act += (write.to(acc_dtype).square() * inv_r.to(acc_dtype).square()).sum(0).double()
    elif acc.kind == "kv-kv":
        a = (write * inv_r).view(-1, shape.num_query_heads, shape.head_dim).transpose(0, 1).to(acc_dtype)  # [H, T, hd]
        acc.cov += torch.bmm(a.transpose(1, 2), a).double()
    else:
        beta2 = (write * inv_r).to(acc_dtype).square()  # [T, I] sender
        A, B = receiver["A"].to(acc_dtype), receiver["B"].to(acc_dtype)  # [T, I] receiver, weighted
        acc.aa += (beta2.t() @ A.square()).double()
        acc.ab += (beta2.t() @ (A * B)).double()
        acc.bb += (beta2.t() @ B.square()).double()
        per_expert = receiver["expert_weight"]  # [T, E] or None (dense: every token's weight 1)
        acc.beta += (beta2.sum(0)[:, None] if per_expert is None
                     else beta2.t() @ per_expert.to(acc_dtype).square()).double()


def _qkv_rows(attn: Any, shape: ModelShape) -> list[torch.Tensor]:
    """W^qkv_g per group g: [C, D] each (its query heads' q rows, its k and v rows)."""
    hd, per_group = shape.head_dim, shape.heads_per_group
    q = attn.q_proj.weight.view(shape.num_kv_groups, per_group * hd, -1)
    k = attn.k_proj.weight.view(shape.num_kv_groups, hd, -1)
    v = attn.v_proj.weight.view(shape.num_kv_groups, hd, -1)
    return [torch.cat([q[g], k[g], v[g]]) for g in range(shape.num_kv_groups)]


def _scores(fo: np.ndarray, add: np.ndarray) -> EdgeScores:
    """{score name: matrix} in `SCORES`' order (FO, ADD); a receiving KV group's one score serves both."""
    return dict(zip(SCORES, (fo, add), strict=True))


def _finalise_edge(acc: _EdgeAccumulator, pair: Pair, layers: Any, shape: ModelShape, tokens: int,
                   routing: Routing | None) -> EdgeScores:
    sender, receiver = layers[pair[0] // 2], layers[pair[1] // 2]
    G, per_group = shape.num_kv_groups, shape.heads_per_group
    if acc.kind == "up":
        down_norm = ffn_units(receiver, routing).down.double().square().sum(0)  # [I]
        fo = (acc.layer.fo / tokens * down_norm).view(G, per_group, -1).sum(1)
        add = (acc.layer.add / tokens).view(G, per_group, -1).sum(1)
        return _scores(fo.cpu().numpy(), add.cpu().numpy())
    if acc.kind == "down":
        weight = _down_weight_norms(receiver, ffn_units(sender, routing).down, shape)  # [I, G]
        matrix = ((acc.act / tokens)[:, None] * weight).cpu().numpy()
        return _scores(matrix, matrix)
    if acc.kind == "kv-kv":
        H, hd = shape.num_query_heads, shape.head_dim
        w_o = sender.self_attn.o_proj.weight.double().view(-1, H, hd)  # [D, H, hd]
        gamma = receiver.input_layernorm.weight.double()
        cov = acc.cov / tokens  # [H, hd, hd]
        scores = torch.zeros(H, G, dtype=torch.float64)
        for g, rows in enumerate(_qkv_rows(receiver.self_attn, shape)):
            fold = torch.einsum("cd,dhe->hce", rows.double() * gamma, w_o)  # F_hg: [H, C, hd]
            scores[:, g] = quadratic_trace(fold, cov).cpu()
        matrix = scores.view(G, per_group, G).sum(1).numpy()
        return _scores(matrix, matrix)
    theirs = ffn_units(receiver, routing)
    gamma = receiver.post_attention_layernorm.weight.double()
    c = gamma[:, None] * ffn_units(sender, routing).down.double()  # [D, I] sender columns through γ
    mg = c.t() @ theirs.gate.double().t()  # [I, I]
    mu = c.t() @ theirs.up.double().t()
    down_norm = theirs.down.double().square().sum(0)  # [I] receiver
    fo = sum_of_squares(mg, mu, acc.aa, acc.ab, acc.bb) / tokens * down_norm
    I, blocks = mg.shape[1], acc.beta.shape[1]  # the receiver's units, in blocks of one weight (its experts)
    add = ((mg.square() + mu.square()).view(-1, blocks, I // blocks) * (acc.beta / tokens)[:, :, None]).view(-1, I)
    return _scores(fo.cpu().numpy(), add.cpu().numpy())


def sum_of_squares(mg: torch.Tensor, mu: torch.Tensor, aa: torch.Tensor, ab: torch.Tensor,
                   bb: torch.Tensor) -> torch.Tensor:
    """Σ_t β_t² (mg·A_t + mu·B_t)² from its accumulated moments (aa = Σ β²A², ab = Σ β²AB, bb = Σ β²B²), elementwise.
    A sum of squares, but its expansion cancels where mg·A ≈ −mu·B and rounds to about −1e-14 there: clamped at 0
    (an affinity is non-negative, and ScheduleAffinity refuses a negative entry)."""
    return (mg.square() * aa + 2 * mg * mu * ab + mu.square() * bb).clamp_min(0.0)


def quadratic_trace(fold: torch.Tensor, cov: torch.Tensor) -> torch.Tensor:
    """tr(F_h Σ_h F_hᵀ) per sending head h (fold [H, C, hd], cov [H, hd, hd] a sum of outer products): non-negative,
    but where F_h's rows lie in Σ_h's null space (a head that writes nothing the receiver reads) its elementwise
    sum rounds to about ±1e-16; clamped at 0 as `sum_of_squares` is, for the same reason."""
    return (torch.bmm(fold, cov) * fold).sum((1, 2)).clamp_min(0.0)  # [H]


SPARSE_ENTRY = 16  # bytes of one kept entry of a SparseEdge: int32 row and column, float64 value
KEPT_MASS = 0.95  # the default mass a sparse neuron → neuron edge keeps (issue 29)


def sparse_entries(pairs: list[Pair], shape: ModelShape, memory_limit: int) -> int | None:
    """The entries the neuron → neuron matrices (FO and ADD of each edge) may keep together so that the
    finished edges fit `memory_limit`; None when every edge fits dense."""
    dense = sum(dense_edge_bytes(p, shape) for p in pairs)
    if dense <= memory_limit or not any(edge_kind(p) == "neuron-neuron" for p in pairs):
        return None  # all dense, or only G-sized edges: nothing to cut
    rest = sum(dense_edge_bytes(p, shape) for p in pairs if edge_kind(p) != "neuron-neuron")
    return max(0, memory_limit - rest) // SPARSE_ENTRY


class _EntryPool:
    """Shares the entries among the neuron → neuron matrices as they are finished: each may take an even
    share of what is left, so entries one matrix does not need for its kept mass go to the later ones."""

    def __init__(self, entries: int, matrices: int) -> None:
        self.left, self.matrices = entries, matrices

    def store(self, matrix: np.ndarray, kept_mass: float) -> EdgeMatrix:
        share = self.left // max(1, self.matrices)
        sparse = SparseEdge.keeping(matrix, kept_mass, share)
        # dense where that is no larger (and so within the share too)
        kept: EdgeMatrix = matrix if sparse.nbytes >= matrix.nbytes else sparse
        self.left -= matrix.nbytes // SPARSE_ENTRY if kept is matrix else sparse.values.size
        self.matrices -= 1
        return kept


@torch.no_grad()
def edge_pass(model: Any, blocks: torch.Tensor, pairs: Iterable[Pair], *, batch_size: int = 4,
              token_chunk: int = 128, memory_limit: int = EDGE_MEMORY_LIMIT, kept_mass: float = KEPT_MASS,
              progress: Progress | None = None, should_stop: ShouldStop | None = None,
              skip_positions: int = 0) -> dict[Pair, EdgeScores]:
    """The FO and ADD scores of every edge (m, t) in `pairs` (raw per-token means, not normalised).

    memory_limit: bytes the finished edges may take; above it the neuron → neuron edges are kept as their
    largest entries up to `kept_mass` of each matrix's mass, as many as the limit allows (`SparseEdge`,
    which records the mass it kept; `_EntryPool` shares the limit among them). It also bounds the pass's
    accumulators: the edges are computed in as many passes over the blocks as that takes (`edge_rounds`;
    one pass when they fit), each finished edge cut before the next pass — so the pass's peak is about
    twice the limit (the kept edges and one pass's accumulators).
    """
    if not 0 < kept_mass <= 1:
        raise ValueError(f"kept_mass must be in (0, 1], got {kept_mass}")
    check_skip_positions(blocks, skip_positions)
    pairs = sorted(set(pairs))
    if not pairs:
        return {}
    shape = model_shape(model.config)
    entries = sparse_entries(pairs, shape, memory_limit)
    pool = None if entries is None else _EntryPool(entries, 2 * sum(edge_kind(p) == "neuron-neuron" for p in pairs))
    rounds = edge_rounds(pairs, shape, memory_limit)
    scores: dict[Pair, EdgeScores] = {}
    for index, round_pairs in enumerate(rounds):

        def round_progress(stage: str, fraction: float, index: int = index) -> None:
            if progress is not None:
                progress(stage, (index + fraction) / len(rounds))

        found = _edge_round(model, blocks, round_pairs, shape, batch_size=batch_size, token_chunk=token_chunk,
                            progress=round_progress, should_stop=should_stop, skip_positions=skip_positions)
        for pair, edge in found.items():  # cut now: the next pass's accumulators take the room
            scores[pair] = ({name: pool.store(np.asarray(m), kept_mass) for name, m in edge.items()}
                            if pool is not None and edge_kind(pair) == "neuron-neuron" else edge)
    return scores


def _edge_round(model: Any, blocks: torch.Tensor, pairs: list[Pair], shape: ModelShape, *, batch_size: int,
                token_chunk: int, progress: Progress, should_stop: ShouldStop | None,
                skip_positions: int = 0) -> dict[Pair, EdgeScores]:
    """One pass over the blocks: the dense scores of `pairs` (over each block's positions from
    `skip_positions` on)."""
    dense = DTPModel(model, devices=1, delta=0)
    routing = dense.decoder.routing  # an MoE model's (its units are the experts' neurons), None: dense
    layers: Any = decoder_layers(model)
    device = next(model.parameters()).device
    accs = {p: _EdgeAccumulator(p, shape, device) for p in pairs}
    last_read = {m: max(t for mm, t in pairs if mm == m) for m, _ in pairs}
    n_blocks = blocks.shape[0]
    for start in range(0, n_blocks, batch_size):
        if should_stop is not None and should_stop():
            raise Cancelled(f"edge affinity pass cancelled after {start} of {n_blocks} blocks")
        ids = blocks[start : start + batch_size].to(device)  # [B, S]
        emb = model.model.embed_tokens(ids)  # [B, S, D]
        cos, sin = dense.rotary(ids, emb)
        x = emb.reshape(-1, emb.shape[-1])  # [T, D]
        keep = counted(ids.shape, skip_positions, x.device)  # [T, 1] or None
        writes: dict[int, torch.Tensor] = {}  # module -> its units' writes, kept until last read
        for t in range(2 * shape.num_layers):
            layer = layers[t // 2]
            incoming = [m for m in writes if (m, t) in accs]
            if t % 2 == 0:
                receiver: dict[str, Any] = {"inv_r": _rms_inverse(x, dense.eps)}
                heads_out = dense.attention_heads(t // 2, x.view(1, *emb.shape), cos, sin)[0]  # [T, H*hd]
                for m in incoming:
                    _accumulate(accs[(m, t)], (m, t), writes[m], receiver, layers, shape, token_chunk)
                write, x = heads_out, x + heads_out @ layer.self_attn.o_proj.weight.t()
            else:
                receiver = _receiver_ffn(layer, x, dense.eps, routing)
                for m in incoming:
                    _accumulate(accs[(m, t)], (m, t), writes[m], receiver, layers, shape, token_chunk)
                write = receiver["act"]  # [T, I] w α: the units' writes (an MoE output's Σ_e w_e Σ_j α_ej w^d_ej)
                x = x + write @ receiver["units"].down.t()
            writes = {m: w for m, w in writes.items() if last_read[m] > t}
            if t in last_read:  # a sender's skipped tokens write nothing into the sums
                writes[t] = write if keep is None else write * keep.to(write.dtype)
            if t % 2:  # per layer
                progress("affinity", (start + ids.shape[0] * (t + 1) / (2 * shape.num_layers)) / n_blocks)
    tokens = counted_tokens(blocks, skip_positions)
    return {p: _finalise_edge(accs.pop(p), p, layers, shape, tokens, routing) for p in pairs}


def schedule_affinity_pass(model: Any, blocks: torch.Tensor, *, schedule: Schedule | None,
                           edge_memory_limit: int = EDGE_MEMORY_LIMIT, edge_kept_mass: float = KEPT_MASS,
                           progress: Progress | None = None, **options: Any) -> AffinityResult:
    """`affinity_pass` (the paper's chain; `options` are its) plus the edges `schedule` adds beyond it.

    schedule None: the chain only, exactly `affinity_pass`; else the result records the schedule and the
    further edges' FO and ADD scores (`AffinityResult.edges`). With further edges the stage's progress is
    reported in two halves: the chain's pass, then the edges'. `model`: a loaded model or a layer source
    (`models.streaming.source`); the further edges need every weight at once, which a streamed model refuses
    (MemoryLimitError naming the fix) before any pass runs.
    """
    source = layer_source(model)
    if schedule is None:
        return affinity_pass(source, blocks, progress=progress, **options)
    shape = model_shape(source.config)
    further = further_pairs(schedule, shape.num_layers)
    whole = source.whole_model(f"schedule {schedule} needs edges beyond the paper's chain, which only the "
                               f"in-memory affinity pass scores") if further else None
    chain_progress, edge_progress = progress, progress
    if further and progress is not None:
        outer = progress

        def chain_progress(stage: str, fraction: float) -> None:
            outer(stage, fraction / 2)

        def edge_progress(stage: str, fraction: float) -> None:
            outer(stage, 0.5 + fraction / 2)

    result = affinity_pass(source, blocks, progress=chain_progress, **options)
    if whole is not None:
        result.edges = edge_pass(whole, blocks, further, batch_size=options.get("batch_size", 4),
                                 token_chunk=options.get("token_chunk", 128), memory_limit=edge_memory_limit,
                                 kept_mass=edge_kept_mass, progress=edge_progress,
                                 should_stop=options.get("should_stop"),
                                 skip_positions=options.get("skip_positions", 0))
    result.schedule = str(schedule)
    return result

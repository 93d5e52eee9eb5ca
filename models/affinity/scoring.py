"""The affinity pass (§3 of the paper): how much each FFN neuron depends on each KV group of its
layer (the up edge) and how much each KV group of the next layer depends on each neuron (the down
edge), estimated in one no-grad forward of the dense model over calibration blocks.

Per layer i, with x the residual entering the FFN pre-norm, r = rms(x), γ its gain, a_h head h's
attention output, W_o^(h) its slice of o_proj and p_h = γ ⊙ (a_h W_o^(h)) / r:

    up, FO:   S↑[g,k] = Σ_{h∈g} E_t[Δ_hk²] · ‖w^d_k‖²,
              Δ_hk = silu'(g_k) u_k (p_h·w^g_k) + silu(g_k) (p_h·w^u_k)              (5)
    up, ADD:  Σ_{h∈g} E_t[(p_h·w^g_k)² + (p_h·w^u_k)²]
    down:     S↓[k,g] = E_t[α_k² / r'²] · ‖W^qkv_g (γ' ⊙ w^d_k)‖²    (into layer i+1's group g)

p_h·w_k is computed without the hidden-size vector p_h: γ and each head's slice of W_o are folded
into the gate/up weights once per layer and micro-batch ([H, hd, I]), so a head costs hd, not
hidden_size, multiply-adds per neuron; tokens are chunked so the [H, tokens, I] terms stay small.

A mixture-of-experts model's units are its experts' neurons, and each token's terms are weighted by the
square of its router's gate weight for the neuron's expert (0 where the token does not reach it):
`models.affinity.units`, which also reads either kind of FFN as the same three matrices.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

# The result and its file are torch-free (models.affinity.file), re-exported where callers import them.
from models.affinity.file import AffinityResult as AffinityResult
from models.affinity.units import FfnUnits, ffn_units
from models.base.progress import Cancelled as Cancelled  # where callers of the pass have imported it from
from models.base.progress import Progress, ShouldStop
from models.base.shapes import ModelShape
from models.families import model_shape
from models.sim.dtp import DTPModel, rms_norm
from models.sim.permute import decoder_layers
from models.streaming.source import layer_source


def sum_dtype(dtype: torch.dtype) -> torch.dtype:
    """What a micro-batch's sums over tokens are accumulated in: float32 at least (a bf16/fp16 model's
    products are exact enough per token, but thousands of them summed in bf16 lose whole percents)."""
    return torch.promote_types(dtype, torch.float32)


class LayerAccumulator:
    """float64 sums over tokens for one layer; each micro-batch is summed in `sum_dtype` (fp32 at least)."""

    def __init__(self, heads: int, neurons: int, device: torch.device) -> None:
        self.fo = torch.zeros(heads, neurons, dtype=torch.float64, device=device)  # Σ_t Δ²: [H, I]
        self.add = torch.zeros(heads, neurons, dtype=torch.float64, device=device)  # Σ_t c_g² + c_u²: [H, I]
        self.act = torch.zeros(neurons, dtype=torch.float64, device=device)  # Σ_t α² / r'²: [I]


# Neuron columns per bmm: keeps each head's [hd, block] fold slice in L2 and the [H, t, block]
# products in L3 (measured ~2x faster on CPU than one [hd, I] product).
NEURON_BLOCK = 1024

Fold = list[tuple[slice, torch.Tensor, torch.Tensor]]


def _fold(model_layer: Any, units: FfnUnits, heads: int, head_dim: int, block: int = NEURON_BLOCK,
          receiver: Any = None) -> Fold:
    """W_o^(h)ᵀ diag(γ) W_gᵀ and W_o^(h)ᵀ diag(γ) W_uᵀ in neuron blocks: [(cols, [H, hd, b], [H, hd, b]), ...].
    W_o is `model_layer`'s; γ and the FFN `units` are `receiver`'s (a later layer's, for the edges beyond the
    chain; None: the same layer, the chain's up score)."""
    w_o = model_layer.self_attn.o_proj.weight  # [D, H*hd]
    gamma = (model_layer if receiver is None else receiver).post_attention_layernorm.weight  # [D]
    w_o_heads = w_o.t().reshape(heads, head_dim, -1)  # [H, hd, D]
    neurons = units.gate.shape[0]
    out = []
    for start in range(0, neurons, block):
        cols = slice(start, min(neurons, start + block))
        fold_g = torch.matmul(w_o_heads, gamma[:, None] * units.gate[cols].t())  # [H, hd, b]
        fold_u = torch.matmul(w_o_heads, gamma[:, None] * units.up[cols].t())
        out.append((cols, fold_g, fold_u))
    return out


def _accumulate_up(acc: LayerAccumulator, heads_out: torch.Tensor, inv_r: torch.Tensor, gate: torch.Tensor,
                   up: torch.Tensor, fold: Fold, token_chunk: int, weight: torch.Tensor | None = None) -> None:
    """heads_out: [T, H*hd]; inv_r: [T, 1]; gate/up: [T, I]; fold: neuron blocks of [H, hd, b]; weight: [T, I]
    each token's weight of each unit (an MoE router's gate weight of the unit's expert), None: all 1."""
    if weight is not None:
        _accumulate_up_weighted(acc, heads_out, inv_r, gate, up, fold, token_chunk, weight)
        return
    heads, head_dim = fold[0][1].shape[:2]
    acc_dtype = sum_dtype(gate.dtype)
    a = (heads_out * inv_r).view(-1, heads, head_dim).transpose(0, 1).contiguous()  # [H, T, hd]: a_h / r
    # ADD needs only the second moment of a_h/r: Σ_t (a·f)² = fᵀ (Σ_t a aᵀ) f, per head and fold column;
    # the moment is a sum over tokens, so it is formed in acc_dtype.
    a_acc = a.to(acc_dtype)
    cov = torch.bmm(a_acc.transpose(1, 2), a_acc)  # [H, hd, hd]
    sig = torch.sigmoid(gate)
    silu = gate * sig
    coef_g = sig.mul_(1 + gate * (1 - sig)).mul_(up)  # silu'(g)·u: [T, I]
    fo = torch.zeros(heads, gate.shape[1], dtype=acc_dtype, device=gate.device)  # [H, I]
    add = torch.zeros_like(fo)
    for cols, fold_g, fold_u in fold:
        fg, fu = fold_g.to(acc_dtype), fold_u.to(acc_dtype)
        add[:, cols] = (torch.bmm(cov, fg) * fg).sum(1) + (torch.bmm(cov, fu) * fu).sum(1)
        for start in range(0, a.shape[1], token_chunk):
            rows = slice(start, start + token_chunk)
            delta = torch.bmm(a[:, rows], fold_g).mul_(coef_g[rows, cols])  # silu'(g)u (p_h·w^g): [H, t, b]
            delta.addcmul_(torch.bmm(a[:, rows], fold_u), silu[rows, cols])  # + silu(g) (p_h·w^u) = Δ_hk
            fo[:, cols] += delta.to(acc_dtype).square_().sum(1)  # per token in the model's dtype, summed in fp32
    acc.fo += fo.double()
    acc.add += add.double()


def _accumulate_up_weighted(acc: LayerAccumulator, heads_out: torch.Tensor, inv_r: torch.Tensor, gate: torch.Tensor,
                            up: torch.Tensor, fold: Fold, token_chunk: int, weight: torch.Tensor) -> None:
    """`_accumulate_up` with each token's terms of unit u scaled by weight[t, u] (so FO and ADD by its square):
    ADD is then a weighted sum over tokens, formed per token chunk beside FO rather than from a covariance."""
    heads, head_dim = fold[0][1].shape[:2]
    acc_dtype = sum_dtype(gate.dtype)
    a = (heads_out * inv_r).view(-1, heads, head_dim).transpose(0, 1).contiguous()  # [H, T, hd]: a_h / r
    sig = torch.sigmoid(gate)
    silu_w = gate * sig * weight  # w silu(g): [T, I]
    coef_g = sig * (1 + gate * (1 - sig)) * up * weight  # w silu'(g) u
    weight_sq = weight.to(acc_dtype).square()
    fo = torch.zeros(heads, gate.shape[1], dtype=acc_dtype, device=gate.device)  # [H, I]
    add = torch.zeros_like(fo)
    for cols, fold_g, fold_u in fold:
        for start in range(0, a.shape[1], token_chunk):
            rows = slice(start, start + token_chunk)
            pg, pu = torch.bmm(a[:, rows], fold_g), torch.bmm(a[:, rows], fold_u)  # p_h·w^g, p_h·w^u: [H, t, b]
            add[:, cols] += ((pg.to(acc_dtype).square() + pu.to(acc_dtype).square()) * weight_sq[rows, cols]).sum(1)
            delta = pg * coef_g[rows, cols] + pu * silu_w[rows, cols]  # w Δ_hu
            fo[:, cols] += delta.to(acc_dtype).square().sum(1)
    acc.fo += fo.double()
    acc.add += add.double()


def _down_weight_norms(next_layer: Any, w_down: torch.Tensor, shape: ModelShape) -> torch.Tensor:
    """‖W^qkv_g (γ' ⊙ w^d_k)‖² for every neuron k and next-layer KV group g: [I, G]."""
    attn = next_layer.self_attn
    gamma = next_layer.input_layernorm.weight  # [D]
    scaled = gamma[:, None] * w_down  # [D, I]
    hd, per_group, groups = shape.head_dim, shape.heads_per_group, shape.num_kv_groups
    q = (attn.q_proj.weight @ scaled).view(groups, per_group * hd, -1)  # [G, r*hd, I]
    k = (attn.k_proj.weight @ scaled).view(groups, hd, -1)  # [G, hd, I]
    v = (attn.v_proj.weight @ scaled).view(groups, hd, -1)
    norms = q.double().square().sum(1) + k.double().square().sum(1) + v.double().square().sum(1)  # [G, I]
    return norms.t()


def _rms_inverse(x: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps).to(x.dtype)  # [T, 1]


def counted(batch_shape: torch.Size, skip_positions: int, device: torch.device) -> torch.Tensor | None:
    """[T, 1] 1.0 for the tokens the scores' means count, 0.0 for the first `skip_positions` positions of each
    sequence of a [B, S, ...] micro-batch; None when every token counts."""
    if skip_positions <= 0:
        return None
    keep = (torch.arange(batch_shape[1], device=device) >= skip_positions).repeat(batch_shape[0])  # [B*S]
    return keep[:, None].float()


def check_skip_positions(blocks: torch.Tensor, skip_positions: int) -> None:
    """Refuse a skip that leaves a block [n, S] nothing to count (or is negative), naming what would do."""
    if not 0 <= skip_positions < blocks.shape[1]:
        raise ValueError(f"skip_positions must be in [0, {blocks.shape[1] - 1}] for blocks of {blocks.shape[1]} "
                         f"tokens, got {skip_positions}")


def counted_tokens(blocks: torch.Tensor, skip_positions: int) -> int:
    """The tokens the means divide by: every block's positions from `skip_positions` on."""
    return int(blocks.shape[0] * max(0, blocks.shape[1] - max(0, skip_positions)))


def layer_step(dense: DTPModel, i: int, x: torch.Tensor, batch_shape: torch.Size, cos: torch.Tensor,
               sin: torch.Tensor, acc: LayerAccumulator, fold: Fold, token_chunk: int, *, last: bool,
               skip_positions: int = 0) -> torch.Tensor:
    """Decoder layer i of the dense forward on one micro-batch's residual x [T, D] (batch_shape: [B, S, D]),
    adding its up sums and (unless it is the last layer) its down sums α² / r'² to `acc`, over the tokens
    from position `skip_positions` of each sequence on; returns the residual after the layer;
    `affinity_pass` runs it in either order of `models.streaming.pipelines`."""
    layer: Any = decoder_layers(dense.model)[i]
    units = ffn_units(layer, dense.decoder.routing)
    heads_out = dense.attention_heads(i, x.view(1, *batch_shape), cos, sin)[0]  # [T, H*hd]
    x = x + heads_out @ layer.self_attn.o_proj.weight.t()
    inv_r = _rms_inverse(x, dense.eps)  # [T, 1]
    normed = rms_norm(x, layer.post_attention_layernorm.weight, dense.eps)
    gate = normed @ units.gate.t()  # [T, I]
    up = normed @ units.up.t()
    weight = units.token_weights(normed)  # [T, I] an MoE token's gate weight of each unit's expert; None: dense
    keep = counted(batch_shape, skip_positions, x.device)  # a sender's skipped tokens write nothing
    _accumulate_up(acc, heads_out if keep is None else heads_out * keep.to(heads_out.dtype), inv_r, gate, up,
                   fold, token_chunk, weight)
    act = F.silu(gate) * up  # [T, I]
    if weight is not None:  # an MoE output: Σ_e w_e Σ_j α_ej w^d_ej, every unit's write scaled by its weight
        act = act * weight
    x = x + act @ units.down.t()
    if not last:  # α² / r'², r' the rms of the residual entering layer i+1
        act_sq = act.to(sum_dtype(act.dtype)).square()
        inv = _rms_inverse(x, dense.eps).to(act_sq.dtype)
        if keep is not None:
            act_sq = act_sq * keep.to(act_sq.dtype)
        acc.act += (act_sq * inv.square()).sum(0).double()
    return x


class _ChainPass:
    """The paper's chain scores as a `models.streaming.pipelines.LayerPass`: each micro-batch's residual stream
    through `layer_step`, each layer's terms (`layer_terms`) once every micro-batch has been through it and the
    next layer is loaded (its down score reads that layer's q/k/v)."""

    needs_head = False

    def __init__(self, model: Any, shape: ModelShape, device: torch.device, *, tokens: int, token_chunk: int,
                 neuron_block: int, cache_folds: bool, skip_positions: int = 0) -> None:
        self.dense = DTPModel(model, devices=1, delta=0)  # L=1: the dense forward, built from explicit parts
        self.shape, self.tokens, self.token_chunk, self.neuron_block = shape, tokens, token_chunk, neuron_block
        self.cache_folds, self.device, self.skip_positions = cache_folds, device, skip_positions
        self.accs: dict[int, LayerAccumulator] = {}  # a layer's sums, from its first micro-batch to its close
        self.folds: dict[int, Fold] = {}
        self.up_fo: list[Any] = []
        self.up_add: list[Any] = []
        self.down: list[Any] = []

    def start(self, ids: torch.Tensor) -> torch.Tensor:
        emb = self.dense.model.model.embed_tokens(ids)  # [B, S, D]
        return emb.reshape(-1, emb.shape[-1])  # [T, D] residual stream

    def step(self, i: int, layer: Any, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        shape = self.shape
        fold = self.folds[i] if i in self.folds else _fold(layer, ffn_units(layer, self.dense.decoder.routing),
                                                            shape.num_query_heads, shape.head_dim, self.neuron_block)
        if self.cache_folds:
            self.folds[i] = fold
        if i not in self.accs:
            self.accs[i] = LayerAccumulator(shape.num_query_heads, shape.intermediate_size, self.device)
        cos, sin = self.dense.rotary(ids, x)
        return layer_step(self.dense, i, x, torch.Size((*ids.shape, x.shape[-1])), cos, sin, self.accs[i], fold,
                          self.token_chunk, last=i == shape.num_layers - 1, skip_positions=self.skip_positions)

    def close(self, i: int, layer: Any, next_layer: Any | None) -> None:
        self.folds.pop(i, None)
        fo, add, down = layer_terms(self.accs.pop(i), layer, next_layer, self.shape, self.tokens,
                                    self.dense.decoder.routing)
        self.up_fo.append(fo)
        self.up_add.append(add)
        if down is not None:
            self.down.append(down)

    def finish(self, ids: torch.Tensor, x: torch.Tensor) -> None:
        pass


@torch.no_grad()
def affinity_pass(model: Any, blocks: torch.Tensor, *, batch_size: int = 4, token_chunk: int = 128,
                  cache_folds: bool | None = None, neuron_block: int = NEURON_BLOCK,
                  progress: Progress | None = None,
                  should_stop: ShouldStop | None = None,
                  metadata: dict[str, str] | None = None, spill_dir: Path | None = None,
                  skip_positions: int = 0) -> AffinityResult:
    """Run the dense model over `blocks` [n, S] and return the raw affinity means.

    `model`: a loaded model, or a `models.streaming.source.LayerSource` (a `StreamedModel`: layers outer, two
    decoder layers in memory, the calibration blocks' residual streams kept between layers, spilled under
    `spill_dir` when given); the same result either way (`models.streaming.pipelines`).
    skip_positions: leave each block's first positions out of the means (0: every token counts).
    cache_folds keeps a layer's folded gate/up weights (2·H·hd·I values) across micro-batches instead of
    refolding per micro-batch (in memory: every layer's, at once); None: cache when there is more than one.
    """
    source = layer_source(model)
    shape = model_shape(source.config)
    n_blocks = blocks.shape[0]
    if cache_folds is None:
        cache_folds = n_blocks > batch_size
    check_skip_positions(blocks, skip_positions)
    scores = _ChainPass(source.model, shape, source.device, tokens=counted_tokens(blocks, skip_positions),
                        token_chunk=token_chunk, neuron_block=neuron_block, cache_folds=cache_folds,
                        skip_positions=skip_positions)
    t0 = time.perf_counter()
    batches = [blocks[start : start + batch_size].to(source.device) for start in range(0, n_blocks, batch_size)]
    source.run(scores, batches, label="affinity pass", stage="affinity", progress=progress, should_stop=should_stop,
               spill_dir=spill_dir)
    result = AffinityResult(scores.up_fo, scores.up_add, scores.down, counted_tokens(blocks, skip_positions), shape)
    result.metadata.update(metadata or {})
    result.metadata["seconds"] = f"{time.perf_counter() - t0:.3f}"
    result.metadata.update(source.metadata)
    return result


def layer_terms(acc: LayerAccumulator, layer: Any, next_layer: Any | None, shape: ModelShape, tokens: int,
                routing: Any = None) -> tuple[Any, Any, Any | None]:
    """Layer i's up (FO, ADD) [G, I] and, when there is a layer i+1, down [I, G'] affinity means: what
    needs layer i's down_proj and layer i+1's attention weights (the streamed pass's window of two).
    routing: an MoE model's (`models.sim.moe.Routing`; its units are the experts' neurons), None: dense."""
    per_group = shape.heads_per_group
    w_down = ffn_units(layer, routing).down  # [D, I]
    down_norm = w_down.double().square().sum(0)  # ‖w^d_k‖²: [I]
    fo_heads = acc.fo / tokens * down_norm  # [H, I]
    up_fo = fo_heads.view(shape.num_kv_groups, per_group, -1).sum(1).cpu().numpy()
    up_add = (acc.add / tokens).view(shape.num_kv_groups, per_group, -1).sum(1).cpu().numpy()
    down = None
    if next_layer is not None:
        weight = _down_weight_norms(next_layer, w_down, shape)  # [I, G]
        down = ((acc.act / tokens)[:, None] * weight).cpu().numpy()
    return up_fo, up_add, down

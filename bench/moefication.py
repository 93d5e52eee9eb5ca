"""A dense llama-style model converted into a Mixtral mixture of experts, as MoEfication does (Zhang et al., 2022,
cited in the paper's related work): evidence tooling for issue 46, which has no trained MoE weights to lay out.

Per layer, on calibration text:

1. the FFN's neurons (SwiGLU: h = silu(x·Gᵀ) ⊙ (x·Uᵀ), I of them) are clustered by co-activation into E experts of
   exactly I/E neurons each: balanced k-means on each neuron's activation pattern (|h| over the calibration tokens,
   unit length: two neurons are close when they are large on the same tokens), the iterations' balanced assignment
   greedy (cheapest pairs first), the last one exact (each centroid offered I/E slots,
   `scipy.optimize.linear_sum_assignment`);
2. a linear router is fitted by ridge least squares to predict, from the FFN's input x (the normed stream), each
   expert's activation mass Σ_{j∈e} |h_j| centred per token (only the order within a token matters for top-k):
   MoEfication's router predicts which experts a token's largest activations fall in;
3. the experts' weights are the dense rows and columns: expert e's gate/up rows and down columns are the dense
   FFN's at its neurons (in ascending neuron order, so unit u = e·I_e + j of issue 46's layout is neuron
   experts[e][j]).

MoEfication sums the chosen experts' outputs unweighted; Mixtral weights them by the softmax of the router's
logits renormalised over the top k. The conversion makes the two agree: the router's logits are scaled so that
their spread across experts stays within GATE_SPREAD nats on the calibration tokens (every chosen weight within
about 1 % of 1/k; the order, hence the choice, is the fitted router's), and each expert's down projection is
multiplied by k. With k = E every expert runs, the router is irrelevant and written as zero: the MoE is the dense
model exactly (up to fp rounding). With k < E it is an approximation; `python -m bench.moefication` reports its
KL to the dense model on held-out text for several k (docs/moe.md).

Mixtral, not Qwen3-MoE, is the target: its attention is llama's (no q/k norm, no biases) and its expert is SwiGLU;
Qwen3-MoE's q/k RMSNorm cannot be made the identity.

    .venv/bin/python -m bench.moefication --out var/moe/smollm2-e8k2 --experts 8 --top-k 2 --kl-k 1,2,4,8
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from scipy.optimize import linear_sum_assignment

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

GATE_SPREAD = 2.0**-7  # nats: the router's largest logit spread on the calibration tokens (weights ≈ 1/k)
CONVERTIBLE = ("llama", "mistral")  # llama-style attention without biases: what Mixtral's attention expresses
CONVERSION_FILE = "moefication.json"


class ConversionError(ValueError):
    """The dense model or the requested split cannot be converted."""


# ---- 1. balanced co-activation clusters ------------------------------------------------------------------------

def balanced_assign(cost: np.ndarray, size: int) -> np.ndarray:
    """Labels [N] minimising Σ cost[n, label[n]] with exactly `size` items per cluster (cost [N, E], N = E·size):
    the assignment problem with each cluster offered `size` slots."""
    n, clusters = cost.shape
    if n != clusters * size:
        raise ConversionError(f"balanced_assign: {n} items cannot fill {clusters} clusters of {size}")
    rows, slots = linear_sum_assignment(np.repeat(cost, size, axis=1))  # [N, E·size]
    labels = np.empty(n, dtype=np.int64)
    labels[rows] = slots // size
    return labels


def greedy_balanced_assign(cost: np.ndarray, size: int) -> np.ndarray:
    """Labels [N] with exactly `size` items per cluster, each (item, cluster) pair taken cheapest first while the
    item is free and the cluster has room (cost [N, E]): the fast, not always optimal, step of the k-means
    iterations; the last step is `balanced_assign`."""
    n, clusters = cost.shape
    if n != clusters * size:
        raise ConversionError(f"balanced_assign: {n} items cannot fill {clusters} clusters of {size}")
    labels = np.full(n, -1, dtype=np.int64)
    room = np.full(clusters, size)
    for flat in np.argsort(cost, axis=None, kind="stable"):
        item, cluster = divmod(int(flat), clusters)
        if labels[item] < 0 and room[cluster] > 0:
            labels[item], room[cluster] = cluster, room[cluster] - 1
    return labels


def balanced_kmeans(features: torch.Tensor, clusters: int, *, iters: int = 15, seed: int = 0) -> torch.Tensor:
    """Labels [N] of `features` [N, F] into `clusters` groups of exactly N/clusters, by cosine similarity to the
    centroids (spherical k-means whose assignment step is balanced). Starts from `clusters` distinct items drawn
    with `seed`; iterates the greedy balanced step until no label changes (at most `iters` times), then assigns
    once more to the final centroids exactly (`balanced_assign`)."""
    n = features.shape[0]
    if clusters < 1 or n % clusters:
        raise ConversionError(f"experts: {n} neurons do not split into {clusters} equal experts; pick a divisor of {n}")
    unit = F.normalize(features.double(), dim=1)  # [N, F]
    g = torch.Generator().manual_seed(seed)
    centroids = unit[torch.randperm(n, generator=g)[:clusters]]  # [E, F]
    labels = torch.full((n,), -1, dtype=torch.long)
    for _ in range(iters):
        new = torch.from_numpy(greedy_balanced_assign(-(unit @ centroids.T).numpy(), n // clusters))  # [N]
        if torch.equal(new, labels):
            break
        labels = new
        centroids = F.normalize(torch.zeros_like(centroids).index_add_(0, labels, unit), dim=1)
    return torch.from_numpy(balanced_assign(-(unit @ centroids.T).numpy(), n // clusters))


def experts_of(labels: torch.Tensor, clusters: int) -> torch.Tensor:
    """[E, I/E]: each expert's neurons in ascending order (the row of expert e lists the dense neurons it holds)."""
    return torch.stack([torch.nonzero(labels == e).flatten() for e in range(clusters)])


# ---- 2. the router ----------------------------------------------------------------------------------------------

def expert_mass(h: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """[T, E]: Σ_{j ∈ expert e} |h[t, j]| for activations h [T, I]."""
    return h.abs()[:, experts].sum(dim=-1)


def fit_router(x: torch.Tensor, mass: torch.Tensor, *, ridge: float = 1e-3) -> torch.Tensor:
    """W [E, D] minimising ‖x·Wᵀ − m‖² + λ‖W‖² for inputs x [T, D] and targets m [T, E], the expert masses centred
    per token; λ = ridge · mean diagonal of xᵀx (scale-free)."""
    x64, m64 = x.double(), mass.double()
    target = m64 - m64.mean(dim=1, keepdim=True)  # [T, E]: the order within a token is all top-k reads
    gram = x64.T @ x64  # [D, D]
    lam = ridge * float(gram.diagonal().mean())
    solved = torch.linalg.solve(gram + lam * torch.eye(gram.shape[0], dtype=gram.dtype), x64.T @ target)  # [D, E]
    return solved.T.contiguous()


def flattened(weight: torch.Tensor, x: torch.Tensor, spread: float = GATE_SPREAD) -> torch.Tensor:
    """`weight` scaled so that the largest spread (max − min over experts) of x·Wᵀ over the tokens x is `spread`:
    the same order, softmax weights within e^spread of uniform."""
    logits = x.double() @ weight.double().T  # [T, E]
    widest = float((logits.max(dim=1).values - logits.min(dim=1).values).max())
    if widest == 0.0:
        return torch.zeros_like(weight)
    return weight * (spread / widest)


def mass_recall(scores: torch.Tensor, mass: torch.Tensor, k: int) -> float:
    """The share of the oracle's top-k expert mass that the router's top-k experts hold, over tokens
    (scores, mass [T, E]; 1.0: the router picks the k experts with the most mass on every token)."""
    chosen = mass.gather(1, scores.topk(k, dim=1).indices).sum()
    return float(chosen / mass.topk(k, dim=1).values.sum())


# ---- the conversion ---------------------------------------------------------------------------------------------

@dataclass
class LayerSplit:
    experts: torch.Tensor  # [E, I_e] dense neuron indices, ascending per expert
    router: torch.Tensor  # [E, D] fitted and flattened (GATE_SPREAD)
    stats: dict[str, Any] = field(default_factory=dict)


@dataclass
class Conversion:
    layers: list[LayerSplit]
    about: dict[str, Any]

    @property
    def num_experts(self) -> int:
        return int(self.layers[0].experts.shape[0])

    def as_dict(self) -> dict[str, Any]:
        return {**self.about, "layers": [{"experts": s.experts.tolist(), **s.stats} for s in self.layers]}


def _check_dense(config: Any) -> None:
    kind = getattr(config, "model_type", None)
    if kind not in CONVERTIBLE:
        raise ConversionError(f"model_type {kind!r} cannot be converted: Mixtral's attention expresses "
                              f"{', '.join(CONVERTIBLE)} (llama-style, no q/k norm, no biases)")
    for flag in ("attention_bias", "mlp_bias"):
        if getattr(config, flag, False):
            raise ConversionError(f"{flag}: the dense model has biases, which Mixtral has no place for")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ConversionError(f"hidden_act {config.hidden_act!r}: Mixtral's expert is SwiGLU (silu)")


@torch.no_grad()
def ffn_inputs(model: Any, blocks: torch.Tensor) -> list[torch.Tensor]:
    """Each layer's FFN input (the post-attention normed stream) on `blocks` [B, S]: a list of [B·S, D]."""
    layers = model.model.layers
    seen: list[list[torch.Tensor]] = [[] for _ in layers]
    hooks = [layer.mlp.register_forward_pre_hook(
        lambda _m, args, i=i: seen[i].append(args[0].detach().reshape(-1, args[0].shape[-1]).float()))
        for i, layer in enumerate(layers)]
    try:
        for row in blocks:
            model.model(row[None])  # the decoder alone: the lm_head's logits are not needed here
    finally:
        for hook in hooks:
            hook.remove()
    return [torch.cat(chunks) for chunks in seen]


def activations(mlp: Any, x: torch.Tensor) -> torch.Tensor:
    """h [T, I] = silu(x·Gᵀ) ⊙ (x·Uᵀ): the SwiGLU intermediate the down projection reads."""
    weights = mlp.gate_proj.weight.float(), mlp.up_proj.weight.float()
    return F.silu(x @ weights[0].T) * (x @ weights[1].T)


@torch.no_grad()
def convert(model: Any, blocks: torch.Tensor, *, experts: int, seed: int = 0, cluster_tokens: int = 2048,
            iters: int = 15, fit_share: float = 0.75, log: Any = None) -> Conversion:
    """The clusters and routers of every layer of dense `model` from calibration `blocks` [B, S]. The router is fit
    on the first `fit_share` of the tokens and its mass recall reported on the rest; the clusters are built on
    up to `cluster_tokens` tokens spread over the whole calibration set."""
    _check_dense(model.config)
    width = int(model.config.intermediate_size)
    if experts < 2 or width % experts:
        raise ConversionError(f"experts: {width} FFN neurons split into E equal experts for E ≥ 2 dividing {width}; "
                              f"got {experts}")
    inputs = ffn_inputs(model, blocks)
    splits = []
    for i, (layer, x) in enumerate(zip(model.model.layers, inputs, strict=True)):
        t0 = time.perf_counter()
        h = activations(layer.mlp, x)  # [T, I]
        picked = torch.linspace(0, h.shape[0] - 1, min(cluster_tokens, h.shape[0])).round().long()
        labels = balanced_kmeans(h[picked].abs().T, experts, iters=iters, seed=seed + i)
        groups = experts_of(labels, experts)
        mass = expert_mass(h, groups)  # [T, E]
        cut = max(1, int(fit_share * h.shape[0]))
        weight = fit_router(x[:cut], mass[:cut])
        held = x[cut:] if cut < h.shape[0] else x
        held_mass = mass[cut:] if cut < h.shape[0] else mass
        scores = held.double() @ weight.T
        recall = {str(k): mass_recall(scores, held_mass.double(), k) for k in _ks(experts)}
        share = float(held_mass.sum(dim=0).max() / held_mass.sum())  # the largest expert's share of the mass
        splits.append(LayerSplit(groups, flattened(weight, x).float(),
                                 {"router_mass_recall": recall, "largest_expert_mass_share": share,
                                  "seconds": time.perf_counter() - t0}))
        if log:
            log(f"layer {i}: router mass recall " + ", ".join(f"k={k} {v:.3f}" for k, v in recall.items())
                + f" ({time.perf_counter() - t0:.1f} s)")
    about = {"method": "MoEfication: balanced k-means on |h| activation patterns, ridge least-squares router",
             "experts": experts, "expert_width": width // experts, "seed": seed, "gate_spread": GATE_SPREAD,
             "calibration_tokens": int(blocks.numel()), "cluster_tokens": min(cluster_tokens, int(blocks.numel())),
             "router_fit_tokens": max(1, int(fit_share * blocks.numel()))}
    return Conversion(splits, about)


def first_layers(model: Any, layers: int) -> Any:
    """The model's first `layers` decoder layers (a small setup on the same weights)."""
    if not 1 <= layers <= len(model.model.layers):
        raise ConversionError(f"layers: between 1 and the model's {len(model.model.layers)}, got {layers}")
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:layers]
    return model


def _ks(experts: int) -> list[int]:
    return sorted({1, 2, experts // 4 or 1, experts // 2, experts})


def mixtral_config(dense: Any, *, experts: int, top_k: int) -> Any:
    from transformers import MixtralConfig

    _check_dense(dense)
    if not 1 <= top_k <= experts:
        raise ConversionError(f"top_k: between 1 and the {experts} experts, got {top_k}")
    keep = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "bos_token_id", "eos_token_id",
            "pad_token_id", "rope_parameters")
    kwargs = {k: getattr(dense, k) for k in keep if getattr(dense, k, None) is not None}
    head_dim = getattr(dense, "head_dim", None) or dense.hidden_size // dense.num_attention_heads
    return MixtralConfig(**kwargs, head_dim=head_dim, hidden_act="silu",
                         intermediate_size=dense.intermediate_size // experts, num_local_experts=experts,
                         num_experts_per_tok=top_k, sliding_window=getattr(dense, "sliding_window", None),
                         router_jitter_noise=0.0, output_router_logits=False)


@torch.no_grad()
def to_mixtral(model: Any, conversion: Conversion, *, top_k: int) -> Any:
    """A MixtralForCausalLM (fp32, eval) holding `model`'s weights split as `conversion` says, top_k experts per
    token: attention, norms and embeddings copied; expert e's gate/up rows and down columns the dense ones at its
    neurons, the down columns × top_k (the renormalised gate weights are ≈ 1/top_k); the router flattened, or zero
    with top_k = E (every expert runs: the dense FFN exactly)."""
    from transformers import MixtralForCausalLM

    experts = conversion.num_experts
    config = mixtral_config(model.config, experts=experts, top_k=top_k)
    dense = {k: v.float() for k, v in model.state_dict().items()}
    state = {k: v for k, v in dense.items() if ".mlp." not in k}
    for i, split in enumerate(conversion.layers):
        pre = f"model.layers.{i}.mlp."
        gate, up, down = (dense[pre + f"{p}_proj.weight"] for p in ("gate", "up", "down"))  # [I, D], [I, D], [D, I]
        idx = split.experts  # [E, I_e]
        state[pre + "experts.gate_up_proj"] = torch.cat([gate[idx], up[idx]], dim=1)  # [E, 2·I_e, D]
        state[pre + "experts.down_proj"] = down[:, idx].permute(1, 0, 2) * top_k  # [E, D, I_e]
        state[pre + "gate.weight"] = split.router.float() if top_k < experts else torch.zeros_like(split.router)
    moe = MixtralForCausalLM(config).float()
    missing, unexpected = moe.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ConversionError(f"weights do not map onto Mixtral: missing {sorted(set(missing) - tied)}, "
                              f"unexpected {sorted(unexpected)}")
    if config.tie_word_embeddings:
        moe.tie_weights()
    return moe.eval()


# ---- measuring the approximation --------------------------------------------------------------------------------

@torch.no_grad()
def set_top_k(moe: Any, conversion: Conversion, top_k: int) -> Any:
    """`moe` (from `to_mixtral`) switched in place to `top_k` experts per token: the down projections rescaled by
    top_k / the old k (exact for powers of two), the router flattened or zero as `to_mixtral` writes it."""
    experts = conversion.num_experts
    old = int(moe.config.num_experts_per_tok)
    if not 1 <= top_k <= experts:
        raise ConversionError(f"top_k: between 1 and the {experts} experts, got {top_k}")
    for layer, split in zip(moe.model.layers, conversion.layers, strict=True):
        layer.mlp.experts.down_proj.mul_(top_k / old)
        layer.mlp.gate.weight.copy_(split.router if top_k < experts else torch.zeros_like(split.router))
        layer.mlp.gate.top_k = layer.mlp.top_k = top_k
    moe.config.num_experts_per_tok = top_k
    return moe


@torch.no_grad()
def kl_to_dense(dense: Any, moe: Any, blocks: torch.Tensor, *, conversion: Conversion | None = None,
                top_ks: Sequence[int] = ()) -> dict[int, float]:
    """Mean per-token KL(dense ‖ moe) in nats over `blocks` [B, S] (every position's next-token distribution),
    {top_k: KL} for each of `top_ks` (`moe` switched by `set_top_k` with `conversion`; left at the last), or
    {its own k: KL} without them. The dense model runs once per block."""
    ks = list(top_ks) or [int(moe.config.num_experts_per_tok)]
    if top_ks and conversion is None:
        raise ConversionError("top_ks: give the conversion whose routers set_top_k writes")
    total = dict.fromkeys(ks, 0.0)
    for row in blocks:
        p = F.log_softmax(dense(row[None]).logits.float(), dim=-1)  # [1, S, V]
        for k in ks:
            if top_ks:
                set_top_k(moe, conversion, k)  # type: ignore[arg-type]
            q = F.log_softmax(moe(row[None]).logits.float(), dim=-1)
            total[k] += float((p.exp() * (p - q)).sum())
    return {k: v / blocks.numel() for k, v in total.items()}


def save(moe: Any, tokenizer: Any, conversion: Conversion, out: Path, **extra: Any) -> None:
    """config.json + model.safetensors + the tokenizer + moefication.json (the clusters, router stats, `extra`)."""
    out.mkdir(parents=True, exist_ok=True)
    moe.save_pretrained(out, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    (out / CONVERSION_FILE).write_text(json.dumps({**conversion.as_dict(), **extra}))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from models.data.calibration import CalibrationSpec, load_blocks
    from models.io.assets import smollm2_gguf
    from models.io.loading import ModelSource, load_model, load_tokenizer

    ap = argparse.ArgumentParser(prog="python -m bench.moefication", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a dense llama-style model (default: the packaged SmolLM2-135M)")
    ap.add_argument("--out", type=Path, required=True, help="the Mixtral checkpoint's directory")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2, help="experts per token in the saved checkpoint")
    ap.add_argument("--layers", type=int, default=None, help="keep the dense model's first N layers")
    ap.add_argument("--calib", default="corpus:kjv")
    ap.add_argument("--calib-blocks", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--eval-blocks", type=int, default=16,
                    help="held-out blocks (after the calibration blocks) for the KL to the dense model")
    ap.add_argument("--kl-k", default="", help="comma-separated top-k values whose KL to report (default: none)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    source = ModelSource(args.model or str(smollm2_gguf()))
    torch.manual_seed(args.seed)
    dense = load_model(source).eval()
    if args.layers is not None:
        dense = first_layers(dense, args.layers)
    tokenizer = load_tokenizer(source)
    vocab = int(dense.config.vocab_size)
    calib = CalibrationSpec(source=args.calib, sequences=args.calib_blocks, seq_len=args.seq_len)
    blocks = load_blocks(calib, tokenizer, vocab_size=vocab)
    t0 = time.perf_counter()
    conversion = convert(dense, blocks, experts=args.experts, seed=args.seed, log=lambda s: print(s, flush=True))
    seconds = time.perf_counter() - t0
    moe = to_mixtral(dense, conversion, top_k=args.top_k)
    kls: dict[str, float] = {}
    if args.kl_k:
        held = load_blocks(CalibrationSpec(source=args.calib, sequences=args.eval_blocks, seq_len=args.seq_len,
                                           skip_blocks=args.calib_blocks), tokenizer, vocab_size=vocab)
        ks = [int(s) for s in args.kl_k.split(",")]
        kls = {str(k): v for k, v in kl_to_dense(dense, moe, held, conversion=conversion, top_ks=ks).items()}
        for k in ks:
            print(f"top-{k} of {args.experts}: KL(dense ‖ moe) = {kls[str(k)]:.4f} nats/token on "
                  f"{held.numel()} held-out tokens", flush=True)
        set_top_k(moe, conversion, args.top_k)
    save(moe, tokenizer, conversion, args.out, dense=str(source.path_or_id), top_k=args.top_k,
         calibration={"source": args.calib, "blocks": args.calib_blocks, "seq_len": args.seq_len},
         held_out={"blocks": args.eval_blocks, "skip_blocks": args.calib_blocks}, kl_to_dense=kls,
         convert_seconds=seconds)
    summary = {"out": str(args.out), "experts": args.experts, "top_k": args.top_k, "kl_to_dense": kls,
               "router_mass_recall_mean": {k: float(np.mean([s.stats["router_mass_recall"][k]
                                                             for s in conversion.layers]))
                                           for k in conversion.layers[0].stats["router_mass_recall"]},
               "convert_seconds": round(seconds, 1)}
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()

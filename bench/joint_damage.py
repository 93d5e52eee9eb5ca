"""Issue 29: does the *joint* first-order damage of a layout rank layouts as they train where J_σ does not?

J_σ and the reviewer's missing-FFN-damage measure are sums over (sender unit, receiver unit) pairs: each
pair's score is the damage of removing that one sender's write alone, so the interaction of the writes a
device misses *together* is not in them. A layout that puts correlated senders on one device makes the
other devices miss their coherent sum, whose damage is the square of a sum, not a sum of squares.

The joint damage keeps the first order in the receiver (dense stream held, as the pair scores do) but
removes every sender's write at once, as the schedule does: before module t, device d's stream differs from
the dense one by

    dev_{t,d} = Σ_{m<t} ( [b_m ≤ t] s_m P_{m,d} + [a_m ≤ t] (W_m − P_{m,d}) − W_m )    (the schedule's table)

with W_m module m's dense write and P_{m,d} the part of it written by m's units on device d. Module t's
units on d read p = γ_t ⊙ dev_{t,d} / r_t and take the pair scores' damage of it:

    FFN neuron k:  E[Δ_k²] ‖w^d_k‖²,  Δ_k = silu'(g_k) u_k (p·w^g_k) + silu(g_k) (p·w^u_k)
    KV group g:    E ‖W^qkv_g p‖²

summed over d and the units on d: `ffn` over the FFNs, `attention` over the attentions (different units, so
reported apart). With one sender unit in dev these are that pair's edge score (tests/bench/test_joint_damage.py
checks it against a per-token transcription). A score for ranking layouts, not optimised: it is quadratic in
the assignment.

Rule fixed before its first run on the recorded layouts (2026-12-05, committed with this script):
the joint FFN damage is a better ranking score than J_σ only if it orders more of the recorded pairs that
training separated (every seed of one arm below every seed of the other) than J_σ does, and it "ranks the
other-schedule layout" only if it orders all six pairs of the dtp:2 four-arm run.

    OMP_NUM_THREADS=1 .venv/bin/python bench/joint_damage.py --work var/jd --schedules "dtp:2" --other dtp:1
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

REPO = Path(__file__).resolve().parent.parent
RULE = ("the joint FFN damage is a better ranking score than J_σ only if it orders more of the recorded pairs "
        "that training separated than J_σ does; it ranks the other-schedule layout only if it orders all six "
        "pairs of the dtp:2 four-arm run")


def _unit_masks(heads: np.ndarray, cells: np.ndarray, devices: int, per_group: int, head_dim: int
                ) -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor]]]:
    """Per layer and device: the heads_out columns [H*hd] and the neurons [I] of that device, as bool masks."""
    attn, ffn = [], []
    for i in range(heads.shape[0]):
        cols = np.repeat(heads[i], per_group * head_dim)  # group g's query heads' columns, head-major
        attn.append([torch.from_numpy(cols == d) for d in range(devices)])
        ffn.append([torch.from_numpy(cells[i] == d) for d in range(devices)])
    return attn, ffn


# (module n, device d, block b, p [T, D], the device's normed input [T, D]) → the p whose damage is counted
Deviation = Callable[[int, int, int, torch.Tensor, torch.Tensor], torch.Tensor]


def _device_input(x: torch.Tensor, dev: torch.Tensor, gamma: torch.Tensor, eps: float) -> torch.Tensor:
    """What module n's units on the device read: RMSNorm of the device's own stream x + dev ([T, D], fp64)."""
    stream = x.double() + dev
    return stream * torch.rsqrt(stream.pow(2).mean(-1, keepdim=True) + eps) * gamma.double()


@torch.no_grad()
def joint_damage(model: Any, blocks: torch.Tensor, schedule: Any, heads: np.ndarray, cells: np.ndarray,
                 deviation: Deviation | None = None) -> dict[str, Any]:
    """The joint first-order damage of the layout (heads [N, G], cells [N, I] device ids) under `schedule`
    (a resolved `Schedule`) over `blocks` [n, S], one block at a time: {"ffn", "attention", "per_module"}.
    `deviation`, when given, sees each (module, device, block)'s p and the device's normed input and returns
    the p to score (bench/repairable_damage.py: the part of p its input does not predict)."""
    from models.affinity.edges import _qkv_rows
    from models.families import model_shape
    from models.sim.dtp import DTPModel, rms_norm
    from models.sim.permute import decoder_layers

    shape = model_shape(model.config)
    L, M = schedule.devices, schedule.num_modules
    dense = DTPModel(model, devices=1, delta=0)  # the dense forward, built from explicit parts
    layers: Any = decoder_layers(model)
    hd, per_group = shape.head_dim, shape.heads_per_group
    attn_cols, ffn_units = _unit_masks(heads, cells, L, per_group, hd)
    per_position = np.zeros((M, blocks.shape[1]))  # Σ over blocks of each receiving module's damage by position
    tokens = 0
    for b, block in enumerate(blocks):
        ids = block[None]  # [1, S]
        x = model.model.embed_tokens(ids)[0]  # [T, D] dense residual
        cos, sin = dense.rotary(ids, x[None])
        T, D = x.shape
        dev = torch.zeros(L, T, D, dtype=torch.float64)  # dev_{t,d}: device stream − dense stream
        held: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # m → (W_m [T, D], P_m [L, T, D])
        for n in range(M):
            layer = layers[n // 2]
            i = n // 2
            inv_r = torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + dense.eps)  # [T, 1]: 1 / r_n
            # module n reads dev_{n,d} on device d through its units there
            if n % 2 == 0:
                gamma = layer.input_layernorm.weight.double()
                attn = layer.self_attn
                w = torch.stack(_qkv_rows(attn, shape)).double()  # W^qkv_g: [G, rows, D]
                for d in range(L):
                    p = dev[d] * inv_r * gamma  # [T, D]
                    if deviation is not None:
                        p = deviation(n, d, b, p, _device_input(x, dev[d], gamma, dense.eps))
                    groups = torch.from_numpy(heads[i] == d)
                    per_token = torch.einsum("td,grd->gtr", p, w[groups]).square().sum((0, 2))  # [T]
                    per_position[n, :T] += per_token.numpy()
                heads_out = dense.attention_heads(i, x[None, None], cos, sin)[0]  # [T, H*hd]
                w_o = attn.o_proj.weight  # [D, H*hd]
                write = heads_out @ w_o.t()  # [T, D]
                parts = torch.stack([heads_out[:, c] @ w_o[:, c].t() for c in attn_cols[i]])  # [L, T, D]
            else:
                gamma = layer.post_attention_layernorm.weight
                normed = rms_norm(x, gamma, dense.eps)
                mlp = layer.mlp
                gate, up = normed @ mlp.gate_proj.weight.t(), normed @ mlp.up_proj.weight.t()  # [T, I]
                sig = torch.sigmoid(gate)
                A, B = (sig * (1 + gate * (1 - sig)) * up).double(), (gate * sig).double()
                down_norm = mlp.down_proj.weight.double().square().sum(0)  # ‖w^d_k‖²: [I]
                for d in range(L):
                    k = ffn_units[i][d]
                    p = dev[d] * inv_r * gamma.double()  # [T, D]
                    if deviation is not None:
                        p = deviation(n, d, b, p, _device_input(x, dev[d], gamma, dense.eps))
                    delta = A[:, k] * (p @ mlp.gate_proj.weight[k].double().t()) \
                        + B[:, k] * (p @ mlp.up_proj.weight[k].double().t())  # Δ_k: [T, I_d]
                    per_token = (delta.square() * down_norm[k]).sum(1)  # [T]
                    per_position[n, :T] += per_token.numpy()
                act = F.silu(gate) * up  # [T, I]
                w_d = mlp.down_proj.weight  # [D, I]
                write = act @ w_d.t()
                parts = torch.stack([act[:, k] @ w_d[:, k].t() for k in ffn_units[i]])
            x = x + write
            held[n] = (write.double(), parts.double())
            # the arrivals before module n+1, as the table says (`models.sim.dtp.DTPModel.step`)
            t = n + 1
            dev -= held[n][0]  # module n's write is missing everywhere until its partials arrive
            for m in schedule.own_arriving(t):
                dev += schedule.own_scale[m] * held[m][1]
            for m in schedule.others_arriving(t):
                dev += held[m][0] - held[m][1]
            for m in [m for m in held if schedule.own_arrival[m] <= t
                      and (schedule.other_arrival[m] is None or schedule.other_arrival[m] <= t)]:
                del held[m]  # both its arrivals are past: nothing reads it again
        tokens += T
    per_module = per_position.sum(1) / tokens  # the mean over every token
    per_position /= blocks.shape[0]
    return {"ffn": float(per_module[1::2].sum()), "attention": float(per_module[0::2].sum()),
            "per_module": per_module.tolist(), "per_position": per_position, "tokens": tokens}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from bench.schedule_experiment import RECORDED_SETS
    from bench.schedule_experiment import parse_args as experiment_args
    from bench.schedule_experiment_runs import Experiment, slug
    from models.layouts import layout as layout_mod

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", required=True)
    ap.add_argument("--schedules", default="dtp:2")
    ap.add_argument("--other", default="")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--blocks", type=int, default=None, help="calibration blocks to score on (default: all)")
    ap.add_argument("--calib-sequences", type=int, default=None, help="as the experiment's (default: its)")
    ap.add_argument("--calib-seq-len", type=int, default=None)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    print(f"rule (fixed before the first run): {RULE}", flush=True)
    passthrough = ["--work", args.work, "--schedules", args.schedules, "--other", args.other, *RECORDED_SETS]
    for flag in ("layers", "calib_sequences", "calib_seq_len"):
        if getattr(args, flag) is not None:
            passthrough += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    experiment = Experiment(experiment_args(passthrough))
    blocks = experiment.blocks()[: args.blocks]
    out: dict[str, Any] = {"rule": RULE}
    for schedule in args.schedules.split():
        sched = experiment.schedule(schedule)
        predicted = experiment.predictors(schedule)
        rows = {}
        for arm in experiment.arms(schedule):
            lay = layout_mod.load(experiment.layouts(schedule) / f"{arm}.json")
            t0 = time.perf_counter()
            jd = joint_damage(experiment.model, blocks, sched, lay.kv_group_device, lay.neuron_device)
            rows[arm] = {**{p: v[arm] for p, v in predicted.items()}, "joint_ffn": jd["ffn"],
                         "joint_attention": jd["attention"], "per_module": jd["per_module"],
                         "seconds": time.perf_counter() - t0}
            print(f"{schedule} {arm}: J_damage {rows[arm]['J_damage']:.3f} missing_ffn "
                  f"{-rows[arm]['neg_missing_ffn_damage']:.4g} joint_ffn {jd['ffn']:.4g} "
                  f"joint_attention {jd['attention']:.4g} ({rows[arm]['seconds']:.0f} s)", flush=True)
        out[slug(schedule)] = rows
    if args.out is not None:
        args.out.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()

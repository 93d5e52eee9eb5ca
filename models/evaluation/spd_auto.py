"""spd:auto:K and spd:isolated:K — which layers' attention sync to drop (Sync-Point Drop; issues 20, 29).

A layer's sensitivity is the mean per-token KL(dense ‖ spd:B) on the calibration blocks, spd:B being the
schedule with the attention all-reduce of the layers B dropped (their others' partials arrive after the
FFN), simulated on the storage-order (contiguous) layout, the standard tensor-parallel sharding SPD starts
from. Two rules choose K layers (ties: the lower layer):

    spd:auto:K       cumulative (issue 29): drop the least sensitive layer, re-measure every remaining
                     layer with it dropped, drop the least sensitive again, … K times: each choice sees
                     the damage of the ones before. K rounds of N - r simulations.
    spd:isolated:K   each layer measured alone (spd:i), the K least sensitive: one round of N simulations,
                     which ignores how dropped syncs compound. Kept because it costs ~K/2 times less
                     (SmolLM2-135M, K = 15: 30 simulations, not 345), and it is what issue 20's study ran.
"""

from __future__ import annotations

from typing import Any

import torch

from models.base.progress import Progress
from models.distill.loss import chunked_kl_nll, next_token_targets
from models.evaluation.evaluate import LOGIT_CHUNK
from models.families import model_shape
from models.schedules.grammar import ScheduleError, ScheduleSpec
from models.sim.dtp import DTPModel


@torch.no_grad()
def dropped_kls(model: Any, blocks: torch.Tensor, candidates: list[tuple[int, ...]], *, devices: int,
                batch_size: int = 1, progress: Progress | None = None) -> list[float]:
    """Per candidate set B: mean per-token KL(dense ‖ spd:B) in nats over `blocks` [n, S] (contiguous layout)."""
    device = next(model.parameters()).device
    simulated = [DTPModel(model, devices=devices, schedule="spd:" + ",".join(map(str, sorted(b)))).eval()
                 for b in candidates]
    lm_head = model.lm_head
    sums = [0.0] * len(candidates)
    n, seq_len = blocks.shape
    for start in range(0, n, batch_size):
        ids = blocks[start : start + batch_size].to(device)  # [b, S]
        dense_h = model.model(ids).last_hidden_state.reshape(-1, model.config.hidden_size)  # [T, D]
        targets = next_token_targets(ids)
        for k, sim in enumerate(simulated):
            h = sim.hidden_states(ids).reshape(-1, model.config.hidden_size)  # [T, D]
            sums[k] += chunked_kl_nll(dense_h, h, lm_head, lm_head, targets, LOGIT_CHUNK)[2]
        if progress is not None:
            progress("spd-sensitivity", min(n, start + batch_size) / n)
    return [total / (n * seq_len) for total in sums]


def spd_sensitivities(model: Any, blocks: torch.Tensor, *, devices: int, batch_size: int = 1,
                      progress: Progress | None = None) -> list[float]:
    """Per layer i: mean per-token KL(dense ‖ spd:i) in nats, each layer's sync dropped alone."""
    layers = model_shape(model.config).num_layers
    return dropped_kls(model, blocks, [(i,) for i in range(layers)], devices=devices, batch_size=batch_size,
                       progress=progress)


def least_sensitive(sensitivities: list[float], count: int) -> tuple[int, ...]:
    """The `count` layers of lowest sensitivity (ties: the lower layer), ascending."""
    if not 1 <= count <= len(sensitivities):
        raise ScheduleError(f"spd:auto:{count}: K must be in 1 .. {len(sensitivities)} (the model's layers)")
    order = sorted(range(len(sensitivities)), key=lambda i: (sensitivities[i], i))
    return tuple(sorted(order[:count]))


def cumulative_choice(model: Any, blocks: torch.Tensor, count: int, *, devices: int, batch_size: int = 1,
                      progress: Progress | None = None) -> tuple[tuple[int, ...], list[dict[int, float]]]:
    """The cumulative rule: K rounds, each adding the layer i whose KL(dense ‖ spd:(chosen ∪ {i})) is least
    (ties: the lower layer). Returns the chosen layers (ascending) and each round's {layer: KL}."""
    layers = model_shape(model.config).num_layers
    if not 1 <= count <= layers:
        raise ScheduleError(f"spd:auto:{count}: K must be in 1 .. {layers} (the model's layers)")
    chosen: list[int] = []
    rounds: list[dict[int, float]] = []
    for r in range(count):
        rest = [i for i in range(layers) if i not in chosen]

        def round_progress(stage: str, fraction: float, r: int = r) -> None:
            if progress is not None:
                progress(stage, (r + fraction) / count)

        kls = dropped_kls(model, blocks, [(*chosen, i) for i in rest], devices=devices, batch_size=batch_size,
                          progress=round_progress)
        rounds.append(dict(zip(rest, kls, strict=True)))
        chosen.append(min(rest, key=lambda i: (rounds[-1][i], i)))
    return tuple(sorted(chosen)), rounds


def resolve_spd_auto(spec: ScheduleSpec, model: Any, blocks: torch.Tensor, *, devices: int, batch_size: int = 1,
                     progress: Progress | None = None) -> tuple[ScheduleSpec, list[float], list[dict[int, float]]]:
    """spd:auto:K / spd:isolated:K → (spd:B, each layer's KL dropped alone, the cumulative rule's rounds
    ([] for the isolated rule)); any other spec is returned as is, with [] and []."""
    if spec.kind != "spd-auto":
        return spec, [], []
    if spec.rule == "isolated":
        sensitivities = spd_sensitivities(model, blocks, devices=devices, batch_size=batch_size, progress=progress)
        return spec.with_spd_layers(least_sensitive(sensitivities, spec.count)), sensitivities, []
    chosen, rounds = cumulative_choice(model, blocks, spec.count, devices=devices, batch_size=batch_size,
                                       progress=progress)
    return spec.with_spd_layers(chosen), [rounds[0][i] for i in sorted(rounds[0])], rounds

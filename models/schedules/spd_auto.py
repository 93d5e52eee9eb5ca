"""spd:auto:K — SPD's sensitivity rule (Sync-Point Drop; issue 20): which layers' attention sync to drop.

For each layer i alone, the sensitivity is the mean per-token KL(dense ‖ spd:i) on the calibration blocks,
spd:i being the schedule with only layer i's attention all-reduce dropped (its others' partials arrive
after its FFN), simulated on the storage-order (contiguous) layout, the standard tensor-parallel
sharding SPD starts from. spd:auto:K is spd:B with B the K least sensitive layers (ties: the lower layer).
"""

from __future__ import annotations

from typing import Any

import torch

from models.distill.loss import chunked_kl_nll, next_token_targets
from models.evaluation.resident import LOGIT_CHUNK
from models.families import model_shape
from models.run.progress import Progress
from models.schedules.grammar import ScheduleError, ScheduleSpec
from models.sim.dtp import DTPModel


@torch.no_grad()
def spd_sensitivities(model: Any, blocks: torch.Tensor, *, devices: int, batch_size: int = 1,
                      progress: Progress | None = None) -> list[float]:
    """Per layer i: mean per-token KL(dense ‖ spd:i) in nats over `blocks` [n, S] (contiguous layout)."""
    layers = model_shape(model.config).num_layers
    device = next(model.parameters()).device
    dropped = [DTPModel(model, devices=devices, schedule=f"spd:{i}").eval() for i in range(layers)]
    lm_head = model.lm_head
    sums = [0.0] * layers
    n, seq_len = blocks.shape
    for start in range(0, n, batch_size):
        ids = blocks[start : start + batch_size].to(device)  # [b, S]
        dense_h = model.model(ids).last_hidden_state.reshape(-1, model.config.hidden_size)  # [T, D]
        targets = next_token_targets(ids)
        for i, sim in enumerate(dropped):
            h = sim.hidden_states(ids).reshape(-1, model.config.hidden_size)  # [T, D]
            sums[i] += chunked_kl_nll(dense_h, h, lm_head, lm_head, targets, LOGIT_CHUNK)[2]
        if progress is not None:
            progress("spd-sensitivity", min(n, start + batch_size) / n)
    return [total / (n * seq_len) for total in sums]


def least_sensitive(sensitivities: list[float], count: int) -> tuple[int, ...]:
    """The `count` layers of lowest sensitivity (ties: the lower layer), ascending."""
    if not 1 <= count <= len(sensitivities):
        raise ScheduleError(f"spd:auto:{count}: K must be in 1 .. {len(sensitivities)} (the model's layers)")
    order = sorted(range(len(sensitivities)), key=lambda i: (sensitivities[i], i))
    return tuple(sorted(order[:count]))


def resolve_spd_auto(spec: ScheduleSpec, model: Any, blocks: torch.Tensor, *, devices: int, batch_size: int = 1,
                     progress: Progress | None = None) -> tuple[ScheduleSpec, list[float]]:
    """spd:auto:K → (spd:B, the per-layer sensitivities); any other spec is returned as is, with []."""
    if spec.kind != "spd-auto":
        return spec, []
    sensitivities = spd_sensitivities(model, blocks, devices=devices, batch_size=batch_size, progress=progress)
    return spec.with_spd_layers(least_sensitive(sensitivities, spec.count)), sensitivities

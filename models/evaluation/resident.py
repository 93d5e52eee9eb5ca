"""Dense vs DTP evaluation: perplexities and the per-token KL(dense ‖ DTP) in nats."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch

from models.distill.loss import chunked_kl_nll, next_token_targets
from models.export.resident import permuted_copy
from models.layouts.layout import Layout
from models.run.progress import Progress
from models.schedules.grammar import ScheduleSpec, dtp_spec, parse_schedule
from models.sim.dtp import DTPModel, LastScale

LOGIT_CHUNK = 512  # tokens per chunk of the statistics over the vocabulary


@dataclass(frozen=True)
class EvalResult:
    dense_ppl: float
    dtp_ppl: float
    kl: float
    tokens: int
    blocks: int
    seq_len: int
    devices: int
    delta: int  # the layout's δ
    layout: str
    schedule: str  # the canonical schedule evaluated (dtp:δ of the layout unless another was asked for)
    layout_independent: bool  # the schedule computes the same function under every layout (tp, ladder)

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def schedule_spec(layout: Layout, schedule: str | ScheduleSpec | None) -> ScheduleSpec:
    """The schedule asked for, parsed; None: the layout's own dtp:δ."""
    if schedule is None:
        return dtp_spec(layout.delta)
    return parse_schedule(schedule) if isinstance(schedule, str) else schedule


@torch.no_grad()
def evaluate(model: Any, layout: Layout, blocks: torch.Tensor, *, batch_size: int = 1,
             last_scale: LastScale = "sqrt", schedule: str | ScheduleSpec | None = None,
             progress: Progress | None = None) -> EvalResult:
    """Dense perplexity, DTP perplexity and mean per-token KL(dense ‖ DTP) over `blocks` [n, S].

    `schedule` (a string such as 'pt:2', or a parsed spec) is the communication schedule simulated;
    None is the layout's own dtp:δ.
    """
    spec = schedule_spec(layout, schedule)
    device = next(model.parameters()).device
    dtp = DTPModel(permuted_copy(model, layout), devices=layout.devices, schedule=spec,
                   last_scale=last_scale).eval()
    lm_head = model.lm_head
    n = blocks.shape[0]
    sums = [0.0, 0.0, 0.0]
    for start in range(0, n, batch_size):
        ids = blocks[start : start + batch_size].to(device)  # [b, S]
        dense_h = model.model(ids).last_hidden_state.reshape(-1, model.config.hidden_size)  # [T, D]
        dtp_h = dtp.hidden_states(ids).reshape(-1, model.config.hidden_size)  # [T, D]
        stats = chunked_kl_nll(dense_h, dtp_h, lm_head, lm_head, next_token_targets(ids), LOGIT_CHUNK)
        for k, v in enumerate(stats):  # dense NLL, DTP NLL, KL(dense ‖ DTP)
            sums[k] += v
        if progress:
            progress("eval", min(n, start + batch_size) / n)
    return eval_result(sums, blocks, layout, dtp)


def eval_result(sums: list[float], blocks: torch.Tensor, layout: Layout, dtp: DTPModel) -> EvalResult:
    """The result from the summed dense NLL, DTP NLL and KL over `blocks` [n, S]."""
    n, seq_len = blocks.shape
    predicted = n * (seq_len - 1)
    return EvalResult(
        dense_ppl=math.exp(sums[0] / predicted),
        dtp_ppl=math.exp(sums[1] / predicted),
        kl=sums[2] / (n * seq_len),
        tokens=n * seq_len,
        blocks=n,
        seq_len=seq_len,
        devices=layout.devices,
        delta=layout.delta,
        layout=layout.name,
        schedule=dtp.schedule.name,
        layout_independent=dtp.schedule.layout_independent,
    )

"""Dense vs DTP evaluation: perplexities and the per-token KL(dense ‖ DTP) in nats."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from models.dtp import DTPModel, LastScale
from models.export import permuted_copy
from models.layout import Layout

Progress = Callable[[str, float], None]


@dataclass(frozen=True)
class EvalResult:
    dense_ppl: float
    dtp_ppl: float
    kl: float
    tokens: int
    blocks: int
    seq_len: int
    devices: int
    delta: int
    layout: str

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def chunked_logit_stats(hidden_dense: torch.Tensor, hidden_dtp: torch.Tensor, lm_head: nn.Module,
                        targets: torch.Tensor, chunk: int = 512) -> tuple[float, float, float]:
    """Sums over tokens of (dense NLL, DTP NLL, KL(dense ‖ DTP)), lm_head applied `chunk` tokens at a time.

    hidden_*: [T, D]; targets: [T] (-100 = no next token: counted in KL, not in NLL).
    """
    nll_dense = nll_dtp = kl = 0.0
    for start in range(0, hidden_dense.shape[0], chunk):
        sl = slice(start, start + chunk)
        logp = F.log_softmax(lm_head(hidden_dense[sl]).float(), dim=-1)  # [t, V]
        logq = F.log_softmax(lm_head(hidden_dtp[sl]).float(), dim=-1)
        kl += F.kl_div(logq, logp, log_target=True, reduction="sum").item()
        tgt = targets[sl]
        nll_dense += F.nll_loss(logp, tgt, ignore_index=-100, reduction="sum").item()
        nll_dtp += F.nll_loss(logq, tgt, ignore_index=-100, reduction="sum").item()
    return nll_dense, nll_dtp, kl


@torch.no_grad()
def evaluate(model: Any, layout: Layout, blocks: torch.Tensor, *, batch_size: int = 1,
             last_scale: LastScale = "sqrt", progress: Progress | None = None) -> EvalResult:
    """Dense perplexity, DTP perplexity and mean per-token KL(dense ‖ DTP) over `blocks` [n, S]."""
    device = next(model.parameters()).device
    dtp = DTPModel(permuted_copy(model, layout), devices=layout.devices, delta=layout.delta,
                   last_scale=last_scale).eval()
    lm_head = model.lm_head
    n, seq_len = blocks.shape
    sums = [0.0, 0.0, 0.0]
    for start in range(0, n, batch_size):
        ids = blocks[start : start + batch_size].to(device)  # [b, S]
        targets = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1).reshape(-1)
        dense_h = model.model(ids).last_hidden_state.reshape(-1, model.config.hidden_size)
        dtp_h = dtp.hidden_states(ids).reshape(-1, model.config.hidden_size)
        for k, v in enumerate(chunked_logit_stats(dense_h, dtp_h, lm_head, targets)):
            sums[k] += v
        if progress:
            progress("eval", min(n, start + batch_size) / n)
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
    )

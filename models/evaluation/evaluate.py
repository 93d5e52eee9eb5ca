"""Dense vs DTP evaluation: perplexities and the per-token KL(dense ‖ DTP) in nats, written once for a model
in memory or streamed layer by layer (`models.streaming.source`: the source feeds the pass its layers).

Per micro-batch and decoder layer i: the dense stream through the Hugging Face layer itself, called as the
model's own forward calls it (its arguments caught at the first layer: `_DenseStream`), so the dense stream
is `model.model(ids)`'s to the bit; the L device streams through module 2i and 2i+1 of the DTP recurrence
under the schedule (`DTPModel.step`) on the permuted layer (`LayerSource.permuted`: a permuted copy of a
resident model; a streamed model's layer permuted as it is read, `models.sim.permute.reorder_layer_`). Then
the final norm and the LM head give the statistics (`models.distill.loss.chunked_kl_nll`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from models.base.progress import Progress
from models.distill.loss import chunked_kl_nll, next_token_targets
from models.families import model_shape
from models.layouts.layout import Layout, check_fits
from models.schedules.grammar import ScheduleSpec, dtp_spec, parse_schedule
from models.sim.dtp import DTPModel, LastScale, Streams
from models.streaming.source import LayerSource, layer_source

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


class _FirstLayerReached(Exception):
    pass


@dataclass
class _DenseStream:
    """A micro-batch's dense hidden states [B, S, D] and the arguments the model's forward gives its layers."""

    hidden: torch.Tensor
    kwargs: dict[str, Any]

    @classmethod
    def start(cls, model: Any, ids: torch.Tensor) -> _DenseStream:
        """The model's own forward up to its first decoder layer (the embeddings, positions, rotary
        embedding and mask), its arguments caught there; the layers' weights are not read."""
        caught: dict[str, Any] = {}

        def catch(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            caught["hidden"], caught["kwargs"] = args[0] if args else kwargs.pop("hidden_states"), kwargs
            raise _FirstLayerReached

        hook = model.model.layers[0].register_forward_pre_hook(catch, with_kwargs=True)
        try:
            model.model(ids, use_cache=False)
        except _FirstLayerReached:
            pass
        finally:
            hook.remove()
        return cls(caught["hidden"], caught["kwargs"])

    def step(self, layer: nn.Module) -> None:
        out = layer(self.hidden, **self.kwargs)
        self.hidden = out[0] if isinstance(out, tuple) else out


class _Evaluation:
    """The evaluation as a `models.streaming.pipelines.LayerPass`: the dense and the L device streams of each
    micro-batch through each layer, the statistics from the final norm and the head."""

    needs_head = True

    def __init__(self, source: LayerSource, layout: Layout, spec: ScheduleSpec, last_scale: LastScale) -> None:
        self.source = source
        self.permuted = source.permuted(layout)
        self.dtp = DTPModel(self.permuted.model, devices=layout.devices, schedule=spec, last_scale=last_scale).eval()
        self.hidden_size = int(source.config.hidden_size)
        self.sums = [0.0, 0.0, 0.0]  # dense NLL, DTP NLL, KL(dense ‖ DTP)

    def start(self, ids: torch.Tensor) -> tuple[_DenseStream, Streams]:
        return _DenseStream.start(self.source.model, ids), self.dtp.start(ids)

    def step(self, i: int, layer: nn.Module, ids: torch.Tensor, state: tuple[_DenseStream, Streams]
             ) -> tuple[_DenseStream, Streams]:
        dense, streams = state
        dense.step(layer)
        self.permuted.load_layer(i)
        self.dtp.step(2 * i, streams)
        self.dtp.step(2 * i + 1, streams)
        return state

    def close(self, i: int, layer: nn.Module, next_layer: nn.Module | None) -> None:
        self.permuted.release_layer(i)

    def finish(self, ids: torch.Tensor, state: tuple[_DenseStream, Streams]) -> None:
        dense, streams = state
        model = self.source.model
        dense_h = model.model.norm(dense.hidden).reshape(-1, self.hidden_size)  # [T, D]
        dtp_h = self.dtp.finish(streams).reshape(-1, self.hidden_size)
        lm_head = model.lm_head
        stats = chunked_kl_nll(dense_h, dtp_h, lm_head, lm_head, next_token_targets(ids), LOGIT_CHUNK)
        for k, v in enumerate(stats):
            self.sums[k] += v


@torch.no_grad()
def evaluate(model: Any, layout: Layout, blocks: torch.Tensor, *, batch_size: int = 1,
             last_scale: LastScale = "sqrt", schedule: str | ScheduleSpec | None = None,
             progress: Progress | None = None) -> EvalResult:
    """Dense perplexity, DTP perplexity and mean per-token KL(dense ‖ DTP) over `blocks` [n, S].

    `model`: a loaded model, or a `models.streaming.source.LayerSource` (a `StreamedModel`: read layer by layer,
    every micro-batch's streams kept between layers, for calibration-size inputs). `schedule` (a string such
    as 'pt:2', or a parsed spec) is the communication schedule simulated; None is the layout's own dtp:δ.
    """
    source = layer_source(model)
    spec = schedule_spec(layout, schedule)
    check_fits(layout, model_shape(source.config))
    evaluation = _Evaluation(source, layout, spec, last_scale)
    batches = [blocks[s : s + batch_size].to(source.device) for s in range(0, blocks.shape[0], batch_size)]
    try:
        source.run(evaluation, batches, label="evaluation", stage="eval", progress=progress)
    finally:
        evaluation.permuted.release_all()
    return eval_result(evaluation.sums, blocks, layout, evaluation.dtp)


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

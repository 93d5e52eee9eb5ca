"""`models.evaluation.resident.evaluate` streamed layer by layer over a `StreamedModel`, for calibration-size inputs:
every micro-batch's streams (the dense one and the L DTP devices') are kept between layers, so the
model's weights are read once, one decoder layer at a time.

Per layer i: read it; run its two modules on every micro-batch's dense stream (the dense forward as the
DTP recurrence at L = 1, δ = 0: equal to the Hugging Face forward to float tolerance, not to the bit);
permute it in place (`models.sim.permute.reorder_layer_`, as `permuted_copy` permutes the whole model);
run its two modules on every micro-batch's L device streams under the schedule
(`DTPModel.step`); release it. Then the final norm and the LM head give the same statistics as the
in-memory evaluation (`models.distill.loss.chunked_kl_nll`).
"""

from __future__ import annotations

from typing import Any

import torch

from models.distill.loss import chunked_kl_nll, next_token_targets
from models.evaluation.resident import LOGIT_CHUNK, EvalResult, eval_result, schedule_spec
from models.families import family_for_config, model_shape
from models.layouts.layout import Layout, check_fits
from models.run.progress import Progress
from models.schedules.grammar import ScheduleSpec
from models.sim.dtp import DTPModel, LastScale
from models.sim.permute import reorder_layer_
from models.streaming.layer_source import StreamedModel


@torch.no_grad()
def streamed_evaluate(streamed: StreamedModel, layout: Layout, blocks: torch.Tensor, *, batch_size: int = 1,
                      last_scale: LastScale = "sqrt", schedule: str | ScheduleSpec | None = None,
                      progress: Progress | None = None) -> EvalResult:
    model = streamed.model
    shape = model_shape(model.config)
    family = family_for_config(model.config)
    check_fits(layout, shape)
    dense = DTPModel(model, devices=1, delta=0).eval()
    dtp = DTPModel(model, devices=layout.devices, schedule=schedule_spec(layout, schedule),
                   last_scale=last_scale).eval()
    device = streamed.device
    batches = [blocks[s : s + batch_size].to(device) for s in range(0, blocks.shape[0], batch_size)]
    try:
        streamed.load_embeddings()
        dense_streams = [dense.start(ids) for ids in batches]
        dtp_streams = [dtp.start(ids) for ids in batches]
        streamed.release(model.model.embed_tokens)
        for i in range(shape.num_layers):
            layer = streamed.load_layer(i)
            for stream in dense_streams:
                dense.step(2 * i, stream)
                dense.step(2 * i + 1, stream)
            reorder_layer_(layer, family, shape, layout.group_order(i), layout.neuron_order(i))
            for stream in dtp_streams:
                dtp.step(2 * i, stream)
                dtp.step(2 * i + 1, stream)
            streamed.release_layer(i)
            if progress:
                progress("eval", (i + 1) / (shape.num_layers + 1))
        streamed.load_head()
        lm_head: Any = model.lm_head
        sums = [0.0, 0.0, 0.0]
        hidden = model.config.hidden_size
        for ids, d_stream, p_stream in zip(batches, dense_streams, dtp_streams, strict=True):
            dense_h = dense.finish(d_stream).reshape(-1, hidden)  # [T, D]
            dtp_h = dtp.finish(p_stream).reshape(-1, hidden)
            stats = chunked_kl_nll(dense_h, dtp_h, lm_head, lm_head, next_token_targets(ids), LOGIT_CHUNK)
            for k, v in enumerate(stats):  # dense NLL, DTP NLL, KL(dense ‖ DTP)
                sums[k] += v
        if progress:
            progress("eval", 1.0)
    finally:
        streamed.release_all()
    return eval_result(sums, blocks, layout, dtp)

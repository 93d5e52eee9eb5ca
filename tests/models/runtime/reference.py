"""The references the runtime is compared with: the single-process simulator on the model rebuilt from
the same shards, and the dense Hugging Face model with its own KV cache (both independent of the runtime)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from models.export.files import load_rank_shards
from models.runtime.sampling import Sampling, next_tokens
from models.sim.dtp import DTPCache, DTPModel

Generation = tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]
GREEDY = Sampling()


def simulator_generation(shards_dir: Any, ids: torch.Tensor, steps: int, delta: int | None = None,
                         sampling: Sampling = GREEDY, *, schedule: str | None = None) -> Generation:
    """(prefill logits [B, S, V], decode-step logits [B, V] each, tokens [B, steps+1]) of the simulator
    at dtp:δ (`delta`) or any `schedule`."""
    model, layout = load_rank_shards(shards_dir)
    dtp = DTPModel(model, devices=layout.devices, delta=delta, schedule=schedule)
    generator = None if sampling.greedy else sampling.generator(torch.device("cpu"))
    cache = DTPCache()
    with torch.no_grad():
        prefill = dtp(ids, cache)
        token = next_tokens(prefill[:, -1], sampling, generator)
        out, step_logits = [token], []
        for _ in range(steps):
            logits = dtp(token[:, None], cache)[:, -1]
            step_logits.append(logits)
            token = next_tokens(logits, sampling, generator)
            out.append(token)
    return prefill, step_logits, torch.stack(out, dim=1)


def dense_generation(model: Any, ids: torch.Tensor, steps: int) -> Generation:
    """The same, greedy, from the dense Hugging Face model and its own cache."""
    key = "cache" if "cache" in model(ids[:, :1], use_cache=True) else "past_key_values"  # transformers 5 / 4
    with torch.no_grad():
        out = model(ids, use_cache=True)
        prefill, past = out.logits, out[key]
        token = prefill[:, -1].argmax(-1)
        tokens_, step_logits = [token], []
        for _ in range(steps):
            out = model(token[:, None], use_cache=True, **{key: past})
            past = out[key]
            logits = out.logits[:, -1]
            step_logits.append(logits)
            token = logits.argmax(-1)
            tokens_.append(token)
    return prefill, step_logits, torch.stack(tokens_, dim=1)


def max_logit_error(result: Any, prefill: torch.Tensor, step_logits: list[torch.Tensor]) -> float:
    """max |Δlogit| over the prefill positions and the decode steps."""
    assert result.prefill_logits.shape == tuple(prefill.shape)
    assert result.step_logits.shape == (len(step_logits), *step_logits[0].shape)
    errors = [np.abs(result.prefill_logits - prefill.numpy()).max()]
    errors += [np.abs(result.step_logits[k] - step_logits[k].numpy()).max() for k in range(len(step_logits))]
    return float(max(errors))

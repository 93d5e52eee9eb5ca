"""How much memory a command needs, in memory or streamed, and which of the two runs under a limit.

From the config alone (torch-free: the API checks a job's `max_memory` at submit, the worker and the
commands before any weight is read). Bytes are counted in the compute dtype; the interpreter's own
base (python + torch, ~0.3-0.5 GB on CPU) is not part of any figure.

    in memory   every weight, plus the evaluation's permuted copy (a second set; the export permutes tensor by
                tensor: a few copies of the largest), plus the micro-batch working set (and, on both
                paths, RUNTIME_OVERHEAD: what else the run holds)
    streamed    the affinity pass: two decoder layers (the window the down score needs) + one more while
                a layer is read and cast, the embeddings (read before the first layer, released after),
                the calibration blocks' hidden states (unless spilled to disk) and the working set;
                the export: a few copies of the largest tensor; eval: the affinity pass's window and
                hidden states, L device streams each, plus the final norm and the LM head

`plan_memory` picks in memory when it fits (or no limit is given), else streamed when that fits,
else raises `MemoryLimitError` naming the need, its parts and the limit.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from models.families import find_family, model_shape
from models.io.sizes import format_size

Command = Literal["optimise", "export", "eval"]
# Hidden states above this share of the limit are spilled to disk (models.streaming.hidden_states).
SPILL_SHARE = 0.25
# What a run holds beyond the tensors counted below (Python and torch objects, safetensors and file
# buffers, the allocator's slack): measured 35-60 MiB above the counted need on a 350 MB checkpoint
# (tests/models/test_streaming_proof.py, peak RSS over the command's imports), counted with a margin.
RUNTIME_OVERHEAD = 80 * 2**20


class MemoryLimitError(ValueError):
    """The command cannot run under the memory limit, even streamed."""


@dataclass(frozen=True)
class MemoryPlan:
    limit: int | None
    weights: int  # every weight, in the compute dtype
    in_memory: int  # the need of the in-memory path
    streamed: int  # the need of the streamed path
    stream: bool  # what runs
    spill: bool  # the streamed pass's hidden states go to disk
    parts: tuple[tuple[str, int], ...]  # what the streamed need is made of

    def describe(self) -> str:
        parts = " + ".join(f"{name} {format_size(n)}" for name, n in self.parts if n)
        how = "streamed" if self.stream else "in memory"
        limit = format_size(self.limit) if self.limit is not None else "none"
        return (f"{how} (limit {limit}; in memory needs {format_size(self.in_memory)}, streamed "
                f"{format_size(self.streamed)}: {parts})")


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a compute dtype named in models.io.ids (float32 → 4, bfloat16 → 2)."""
    bits = re.search(r"[0-9]+$", dtype)
    if bits is None:
        raise ValueError(f"not a float dtype name: {dtype!r}")
    return int(bits.group()) // 8


def layer_params(config: Any) -> int:
    """One decoder layer's parameters: attention (q, k, v, o and their biases), SwiGLU FFN, norms."""
    s = model_shape(config)
    family = find_family(s.model_type)  # None outside the registry: counted as the Llama layout
    d, q, kv = s.hidden_size, s.num_query_heads * s.head_dim, s.num_kv_groups * s.head_dim
    attention = d * q * 2 + d * kv * 2
    if getattr(config, "attention_bias", False) or (family is not None and family.qkv_bias):
        attention += q + 2 * kv
    norms = 2 * d + (2 * s.head_dim if family is not None and family.qk_norm else 0)
    # the SwiGLU FFN (an MoE model's E·I_e expert neurons: intermediate_size) and an MoE router [E, D]
    return attention + 3 * d * s.intermediate_size + d * s.num_experts + norms


def embedding_params(config: Any) -> int:
    """embed_tokens (+ lm_head when not tied) + the final norm."""
    d, vocab = config.hidden_size, config.vocab_size
    return vocab * d * (1 if getattr(config, "tie_word_embeddings", False) else 2) + d


def working_bytes(config: Any, batch_tokens: int, item: int) -> int:
    """A micro-batch's activations in the affinity pass (gate, up, act, their fp32 sums, the folded
    gate/up weights, a [H, 128, 1024] token chunk) or a layer's forward."""
    s = model_shape(config)
    per_token = 8 * s.intermediate_size * max(item, 4) + 6 * s.hidden_size * item
    folds = 2 * s.num_query_heads * s.head_dim * s.intermediate_size * item
    return batch_tokens * per_token + folds + 3 * s.num_query_heads * 128 * 1024 * 4


def plan_memory(config: Any, *, dtype: str, command: Command, limit: int | None, tokens: int = 0,
                batch_tokens: int = 0, devices: int = 1, export: bool = False, stream: bool | None = None
                ) -> MemoryPlan:
    """What `command` needs and how it runs under `limit` (None: no limit; in memory unless `stream`).

    tokens: the calibration (or evaluation) tokens whose hidden states the streamed pass keeps;
    batch_tokens: tokens per micro-batch; export: optimise also exports (tensor by tensor, from the weights).
    """
    item = dtype_bytes(dtype)
    s = model_shape(config)
    layer = layer_params(config) * item
    embed = embedding_params(config) * item
    weights = s.num_layers * layer + embed
    work = working_bytes(config, batch_tokens, item)
    largest = max(config.vocab_size * s.hidden_size, s.hidden_size * s.intermediate_size) * max(item, 4)
    export_part = ("the export's largest tensor read, cast, permuted and written", 4 * largest)
    # in memory: the evaluation permutes a deep copy (`ResidentModel.permuted`); the export writes from the
    # loaded weights tensor by tensor (`models.export.writer`), holding a few copies of one tensor at a time
    copies = 2 if command == "eval" else 1
    exporting = command == "export" or export
    in_memory = copies * weights + work + RUNTIME_OVERHEAD + (export_part[1] if exporting else 0)
    embed_tokens = config.vocab_size * s.hidden_size * item
    if command == "export":
        parts: list[tuple[str, int]] = [export_part]
    else:
        streams = devices if command == "eval" else 1
        hidden = tokens * s.hidden_size * item * streams * (3 if command == "eval" else 1)
        # the embeddings (and for eval the head) are resident before or after the layers, never with them
        ends = embed if command == "eval" else embed_tokens
        spill = limit is not None and hidden > SPILL_SHARE * limit and command == "optimise"
        kept = 2 * batch_tokens * s.hidden_size * item if spill else hidden
        window = 3 * layer
        parts = [("two decoder layers and one being read" if window >= ends else
                  ("embeddings, final norm and LM head" if command == "eval" else "the embeddings"), max(window, ends)),
                 ("hidden states" + (" (spilled to disk: two micro-batches in memory)" if spill else ""), kept),
                 ("the micro-batch working set", work)]
        if export and 4 * largest > sum(n for _, n in parts):
            parts = [export_part]
    parts.append(("the run's own allocations beyond its tensors", RUNTIME_OVERHEAD))
    streamed_need = sum(n for _, n in parts)
    spill = any("spilled" in name for name, _ in parts)
    if stream is None:
        stream = limit is not None and in_memory > limit
    plan = MemoryPlan(limit, weights, in_memory, streamed_need, stream, spill, tuple(parts))
    if limit is not None and (plan.streamed if stream else plan.in_memory) > limit:
        need = plan.streamed if stream else plan.in_memory
        raise MemoryLimitError(
            f"{command} of this model needs at least {format_size(need)} "
            f"({'streamed: ' + ' + '.join(f'{n} {format_size(b)}' for n, b in parts if b) if stream else 'in memory'})"
            f"; the memory limit (max_memory) is {format_size(limit)}. Raise the limit"
            + (", or use fewer calibration blocks or a smaller batch_size" if command != "export" else ""))
    return plan

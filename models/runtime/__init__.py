"""A multi-process DTP runtime over torch.distributed for the rank shards `export` writes.

One process per rank (gloo on CPU, NCCL with one GPU per rank). Each rank checks the manifest,
the model shape and its shard's sha256 before any compute, keeps its own residual stream, and runs
the communication schedule the shards were made for (`models.schedules.grammar`; tp, dtp:δ, dtp:δ@K, ladder,
spd:B, pt:D, all from the schedule's table: `models.runtime.arrivals`): each exchange is started
asynchronously once its partials are computed and waited for only where they arrive. Prefill and
cached decoding, greedy or seeded sampling.

- Python: `DTPRuntime.start(shards_dir)` → `.generate(ids)` / `.generate_text(prompt)` → `.stop()`
  (`models.runtime.launcher`).
- Command line: `dtp-layout generate SHARDS_DIR ...` or `python -m models.runtime SHARDS_DIR ...`,
  also under `torchrun --nproc-per-node L -m models.runtime ...` (`models.runtime.cli`).

Importing this package is torch-free; the names below load their modules on first use.
"""

from __future__ import annotations

from typing import Any

from models.runtime.errors import DTPRuntimeError, RankFailure, RuntimeStopped, ShardError

__all__ = ["DTPRuntime", "DTPRuntimeError", "GenerationResult", "RankFailure", "RuntimeStopped", "ShardError"]


def __getattr__(name: str) -> Any:
    if name == "DTPRuntime":
        from models.runtime.launcher import DTPRuntime

        return DTPRuntime
    if name == "GenerationResult":
        from models.runtime.generation import GenerationResult

        return GenerationResult
    raise AttributeError(f"module 'models.runtime' has no attribute {name!r}")

"""How to serve a job's shards with vLLM, as the job's summary carries it (torch-free).

When a job succeeds the worker writes `summary.serve` (`serve_summary`): for shards it exported, the
client's download of `shards/` and `dtp-layout vllm-serve` on them, which runs vLLM at the tensor-parallel
size the shards' manifest records (L); otherwise why there is nothing to serve. The dashboard's job page
and `dtp-layout client status` show those lines as written (docs/serving.md, docs/dashboard.md).
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

__all__ = ["SERVING_DOC", "serve_commands", "serve_lines", "serve_summary"]

SERVING_DOC = "docs/serving.md"


def serve_commands(job_id: str, devices: int) -> list[str]:
    """The client's download of the job's shards into ./<first 8 characters of the id>, then vLLM on them.
    `devices` (L) only shows in the comment: `vllm-serve` reads it from the manifest it downloaded."""
    folder = f"./{job_id[:8]}"
    return [shlex.join(["dtp-layout", "client", "download", job_id, "shards", "--out", folder]),
            shlex.join(["dtp-layout", "vllm-serve", f"{folder}/shards"])
            + f"  # vLLM at --tensor-parallel-size {devices}, the shards' L"]


def serve_summary(job_id: str, *, exported_shards: bool, shards_dir: Path | None) -> dict[str, Any]:
    """`summary.serve` of a succeeded job: `available` with the commands, L, schedule and architecture,
    or `available: false` with `why`."""
    if not exported_shards:
        return {"available": False, "why": "the job exported no shards (its spec has export.shards false or "
                                           "export false): submit it again with shards to serve it with vLLM"}
    manifest_file = (shards_dir or Path("/nonexistent")) / "manifest.json"
    try:
        manifest = json.loads(manifest_file.read_text())
    except (OSError, ValueError):
        return {"available": False, "why": "no shards/manifest.json was exported"}
    serving = manifest.get("serving") if isinstance(manifest, dict) else None
    if not isinstance(serving, dict) or not isinstance(serving.get("devices"), int):
        return {"available": False, "why": "the shards' manifest has no 'serving' record (exported before vLLM "
                                           "serving): export them again"}
    if not serving.get("architecture"):
        return {"available": False, "why": f"the vLLM plugin has no DTP architecture for model_type "
                                           f"{serving.get('model_type')!r} (llama, mistral, qwen2, qwen3)"}
    devices = int(serving["devices"])
    return {"available": True, "devices": devices, "schedule": (serving.get("table") or {}).get("schedule"),
            "architecture": serving["architecture"], "commands": serve_commands(job_id, devices),
            "docs": SERVING_DOC}


def serve_lines(serve: dict[str, Any] | None) -> list[str]:
    """`summary.serve` as the text lines `dtp-layout client status` prints (none for a job without it)."""
    if not isinstance(serve, dict):
        return []
    if not serve.get("available"):
        return [f"serve with vLLM: not available: {serve.get('why', 'no shards')}"]
    head = (f"serve with vLLM (TP = L = {serve.get('devices')}, schedule {serve.get('schedule')}; "
            f"{serve.get('docs', SERVING_DOC)}):")
    return [head, *(f"  {command}" for command in serve.get("commands", []))]

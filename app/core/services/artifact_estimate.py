"""The artifact bytes a job is expected to publish, reserved against its tenant's quota at submit
(app.core.services.usage: a job that would pass the quota is 429 before it runs). The worker raises the
reservation before each publish when the files turn out larger (usage.reserve_more), so a job never
publishes past the quota whatever this estimate says; the estimate only makes the refusal early.

From the model's config (when the API can read it without downloading weights) and the spec:

- affinity.safetensors: up_fo, up_add [G, I] and down [I, G] per layer, float64: 3 × N × G × I × 8,
  twice (the job's artifact and the tenant's cache entry, app.core.services.derived);
- export: the checkpoint and the rank shards each hold every parameter once, at the export dtype
  (auto: the model's dtype; float32 assumed, the largest);
- report.json, layouts, distillation summary, metrics and curves: SMALL_FILES_BYTES;
- a GGUF model's converted copy (app.core.services.derived; made once per tenant and model, reserved by every
  job that loads one: the reservation ends with the job, the copy is then counted as `converted`).
"""

from __future__ import annotations

from typing import Any

from app.core.schemas.jobs import JobSpec
from app.core.services.model_limits import parameter_count
from models.io.ids import DTYPE_BYTES

SMALL_FILES_BYTES = 1 << 20  # report.json (tens of KiB), summary.json, metrics.csv, curves.png (~100 KiB)


def _dimension(config: dict[str, Any], name: str) -> int:
    value = config.get(name)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def affinity_bytes(config: dict[str, Any]) -> int:
    layers, width = _dimension(config, "num_hidden_layers"), _dimension(config, "intermediate_size")
    groups = _dimension(config, "num_key_value_heads") or _dimension(config, "num_attention_heads")
    return 3 * layers * groups * width * 8


def export_bytes(spec: JobSpec, config: dict[str, Any]) -> int:
    copies = int(spec.export.checkpoint) + int(spec.export.shards)
    if not copies:
        return 0
    per_parameter = DTYPE_BYTES[spec.export.dtype if spec.export.dtype != "auto" else spec.model.dtype]
    return copies * (parameter_count(config) or 0) * per_parameter


def converted_bytes(spec: JobSpec, config: dict[str, Any]) -> int:
    """A GGUF model's converted copy: every parameter at the model's dtype."""
    return (parameter_count(config) or 0) * DTYPE_BYTES[spec.model.dtype]


def expected_artifact_bytes(spec: JobSpec, config: dict[str, Any] | None, *, converts: bool = False) -> int:
    """The bytes the job's artifacts (and, with `converts`, a GGUF model's converted copy) are expected to
    take; SMALL_FILES_BYTES alone without a config."""
    if not config:
        return SMALL_FILES_BYTES
    return (SMALL_FILES_BYTES + 2 * affinity_bytes(config) + export_bytes(spec, config)
            + (converted_bytes(spec, config) if converts else 0))

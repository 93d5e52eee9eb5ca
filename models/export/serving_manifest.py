"""What a server needs to run exported shards, recorded by the export (torch-free).

The manifest of `shards/` (`dtp-layout-shards/1`, additive fields) gains:

    serving: {"family", "model_type", "architecture", "num_layers", "devices", "last_scale",
              "table": the schedule's per-module (b_n, s_n, a_n) as `Schedule.as_dict`,
              "provenance": {"layout", "layout_sha256", "layout_schedule", "delta"}}

and `shards/config.json` names the DTP architecture of its family (`architectures: ["DtpLlamaForCausalLM"]`)
and carries the same table under `dtp`, so an engine that reads only config.json (vLLM) runs the schedule
with no extra flags. The project's runtime reads the config by `model_type`, so the architecture name does
not change what it loads. `checkpoint/` stays a plain Hugging Face checkpoint: a server that loads it gets
the table from the manifest (`dtp_config_entry`, `hf_overrides`).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from models.families import FAMILIES
from models.layouts.layout import Layout
from models.schedules.grammar import Schedule, ScheduleError, resolve_schedule

__all__ = ["DTP_ARCHITECTURES", "DTP_CONFIG_FORMAT", "ServingError", "check_entry", "dtp_config_entry",
           "hf_overrides", "serving_fields", "write_serving_config"]

DTP_CONFIG_FORMAT = "dtp-layout-serving/1"

# model_type -> the architecture the vLLM plugin registers for it (models.serving.vllm): its family's record.
DTP_ARCHITECTURES = {model_type: family.vllm.dtp for family in FAMILIES if family.vllm is not None
                     for model_type in family.model_types}


class ServingError(ValueError):
    """Shards or a config that a server cannot run as recorded."""


def _layout_sha256(layout: Layout) -> str:
    text = json.dumps(layout.to_json_dict(), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def serving_fields(model_type: str, family: str, layout: Layout, table: Schedule) -> dict[str, Any]:
    """The manifest's `serving` object for shards made for `table` under `layout`."""
    return {
        "format": DTP_CONFIG_FORMAT,
        "family": family,
        "model_type": model_type,
        "architecture": DTP_ARCHITECTURES.get(model_type),
        "num_layers": table.num_modules // 2,
        "devices": table.devices,
        "last_scale": table.last_scale,
        "table": table.as_dict(),
        "provenance": {"layout": layout.name, "layout_sha256": _layout_sha256(layout),
                       "layout_schedule": layout.made_for, "delta": layout.delta},
    }


def dtp_config_entry(serving: dict[str, Any]) -> dict[str, Any]:
    """The `dtp` entry of config.json (and of vLLM's --hf-overrides): the table a server runs."""
    table = serving["table"]
    return {"format": DTP_CONFIG_FORMAT, "schedule": table["schedule"], "devices": serving["devices"],
            "num_layers": serving["num_layers"], "last_scale": serving["last_scale"],
            "family": serving["family"], "own_arrival": list(table["own_arrival"]),
            "own_scale": list(table["own_scale"]), "other_arrival": list(table["other_arrival"]),
            "layout": serving["provenance"]["layout"]}


def hf_overrides(serving: dict[str, Any]) -> dict[str, Any]:
    """What turns a plain (permuted) checkpoint's config into the DTP architecture, for vLLM's
    `--hf-overrides`: the architecture and the `dtp` entry."""
    architecture = serving.get("architecture")
    if not architecture:
        raise ServingError(f"model_type {serving.get('model_type')!r} has no DTP architecture; supported: "
                           f"{', '.join(sorted(DTP_ARCHITECTURES))}")
    return {"architectures": [architecture], "dtp": dtp_config_entry(serving)}


def write_serving_config(shards_dir: Path, serving: dict[str, Any]) -> None:
    """Rewrite `shards_dir/config.json` to name the DTP architecture and carry the table; the original
    architectures are kept under `dtp_source_architectures`."""
    path = Path(shards_dir) / "config.json"
    config = json.loads(path.read_text())
    overrides = hf_overrides(serving)
    config["dtp_source_architectures"] = config.get("architectures")
    config.update(overrides)
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def check_entry(entry: Any, *, num_layers: int | None = None, tp_size: int | None = None) -> Schedule:
    """A config's `dtp` entry as a checked `Schedule`: the table must be the one its schedule resolves to,
    fit the model's layers, and (tp_size given) L must equal the tensor-parallel size."""
    if not isinstance(entry, dict):
        raise ServingError("config.json has no 'dtp' entry (export writes it into shards/config.json; for a "
                           "permuted checkpoint pass the shards' table with --hf-overrides, as `dtp-layout "
                           "vllm-serve SHARDS --checkpoint DIR` does)")
    if entry.get("format") != DTP_CONFIG_FORMAT:
        raise ServingError(f"config 'dtp'.format must be {DTP_CONFIG_FORMAT!r}, got {entry.get('format')!r}")
    devices, layers = entry.get("devices"), entry.get("num_layers")
    if num_layers is not None and layers != num_layers:
        raise ServingError(f"config 'dtp' is for num_layers={layers}, the model has {num_layers}")
    if tp_size is not None and devices != tp_size:
        raise ServingError(f"the shards are for L={devices} devices (manifest 'devices', config 'dtp'.devices) but "
                           f"the tensor-parallel size is {tp_size}: serve them with --tensor-parallel-size {devices}")
    try:
        table = resolve_schedule(str(entry.get("schedule")), int(layers), int(devices),  # type: ignore[arg-type]
                                 entry.get("last_scale", "sqrt"))
    except (ScheduleError, TypeError, ValueError) as exc:
        raise ServingError(f"config 'dtp': {exc}") from exc
    recorded = (tuple(entry.get("own_arrival", ())), tuple(float(s) for s in entry.get("own_scale", ())),
                tuple(entry.get("other_arrival", ())))
    if recorded != (table.own_arrival, table.own_scale, table.other_arrival):
        raise ServingError(f"config 'dtp': the recorded table is not the one schedule {table.name!r} resolves to "
                           f"for {layers} layers on {devices} devices")
    return table

"""The stages of a job, in the order they run: the one list of stage names (the worker records them, the
API reports them, the dashboard colours them via GET /v1/spec, /metrics counts them). Dependency-free;
models/run/stages.py declares the stages themselves in this order (checked when it is imported)."""

from __future__ import annotations

from typing import Literal, get_args

Stage = Literal["loading", "calibration", "affinity", "optimising", "probing", "stability", "exporting",
                "distilling"]
STAGES: tuple[str, ...] = get_args(Stage)

"""The files of a run directory (a `dtp-layout optimise --out`, a job's work directory), named once.
Torch-free."""

from __future__ import annotations

AFFINITY_FILE = "affinity.safetensors"
REPORT_FILE = "report.json"
RUN_FILE = "run.json"  # the parameters of the run and the stages it finished (models.runner.RunRecord)
BLOCKS_FILE = "blocks.npy"
LAYOUTS_DIR = "layouts"
STABILITY_DIR = "stability"
STABILITY_FILE = "stability.json"
EXPORT_DIRS = ("checkpoint", "shards")

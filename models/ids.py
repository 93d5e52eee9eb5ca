"""Torch-free names of model sources and dtypes, shared by the loader, the exporter, the CLI and the
service's request validation."""

from __future__ import annotations

import re
from typing import Literal, get_args

HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
REVISION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,127}$")
GGUF_FILE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*\.gguf$")

# What a model is loaded and its passes run in (torch's names; models.loading maps them to torch dtypes).
DtypeName = Literal["float32", "bfloat16", "float16"]
DTYPE_NAMES: tuple[DtypeName, ...] = get_args(DtypeName)
# What exported weights are stored in: one of those, or `auto`, the source checkpoint's own dtype.
ExportDtypeName = Literal["auto", DtypeName]
EXPORT_DTYPE_NAMES: tuple[ExportDtypeName, ...] = get_args(ExportDtypeName)

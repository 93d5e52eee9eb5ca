"""Torch-free patterns for model sources, shared by the loader and the service's request validation."""

from __future__ import annotations

import re

HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
REVISION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,127}$")
GGUF_FILE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*\.gguf$")
DTYPE_NAMES = ("float32", "bfloat16", "float16")

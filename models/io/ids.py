"""Torch-free names of model sources and dtypes, shared by the loader, the exporter, the CLI and the
service's request validation."""

from __future__ import annotations

import os
import re
from typing import Literal, get_args

HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
REVISION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,127}$")
GGUF_FILE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*\.gguf$")
# A tenant's own upload (POST /v1/uploads), as a job's model.id or data source: `upload:<32 hex digits>`.
UPLOAD_REF = re.compile(r"^upload:([0-9a-f]{32})$")

# What a model is loaded and its passes run in (torch's names; models.io.loading maps them to torch dtypes).
DtypeName = Literal["float32", "bfloat16", "float16"]
DTYPE_NAMES: tuple[DtypeName, ...] = get_args(DtypeName)
DTYPE_BYTES: dict[DtypeName, int] = dict(zip(DTYPE_NAMES, (4, 2, 2), strict=True))  # bytes per element, in order
# What exported weights are stored in: one of those, or `auto`, the source checkpoint's own dtype.
ExportDtypeName = Literal["auto", DtypeName]
EXPORT_DTYPE_NAMES: tuple[ExportDtypeName, ...] = get_args(ExportDtypeName)


def hf_dataset_refusal(name: str) -> str | None:
    """Why `hf:NAME` is not read, or None: NAME must be a hub dataset id `owner/name`, and must not also
    be a path relative to the working directory.

    `datasets.load_dataset(NAME)` reads the disk before the hub: a bare NAME that is one of its builders
    (`text`, `json`, `csv`, …) reads the data files of the working directory, and a NAME that exists
    there as a directory is loaded as a local dataset. A service's working directory holds its storage
    (every tenant's files, under the embedded default), so neither may ever be chosen by a request. The
    message names only what the caller wrote."""
    if not HUB_ID.fullmatch(name):
        return (f"hf:{name}: hf: sources are hub dataset ids of the form owner/name (e.g. "
                "hf:Salesforce/wikitext:wikitext-2-raw-v1:test); a bare name would be read from the server's "
                "disk, not the hub")
    if os.path.lexists(name):
        return (f"hf:{name}: refused: it is also a path relative to the server's working directory, and hf: "
                "sources are read from the hub only (name local data under the data root, without hf:)")
    return None

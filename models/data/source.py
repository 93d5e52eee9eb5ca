"""A data source as one typed value: the text of a spec's `…source` field (or a model id naming an upload)
parsed once, here, and read by every site that asks what kind of source it is.

    corpus:NAME                       a named text of this install (models.io.assets.CORPORA)
    hf:OWNER/NAME[:CONFIG[:SPLIT]]    a hub dataset (the hf extra)
    upload:ID                         an upload of the service (a job's tenant's)
    anything else                     a path (a local command) or a name under the server's data root (a job)

What each kind may name (a known corpus, a well-formed hub id, an upload of this tenant, a file that
exists) is checked where it is read: parsing only says which kind it is. Torch-free: the API process
imports this module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["ACCEPTED_SOURCES", "DataSource", "DataSourceError", "SourceKind", "is_upload", "parse_data_source"]

SourceKind = Literal["corpus", "hf", "upload", "path"]
PREFIXED: tuple[SourceKind, ...] = ("corpus", "hf", "upload")  # the kinds written `KIND:VALUE`
ACCEPTED_SOURCES = ("corpus:NAME | hf:OWNER/NAME[:CONFIG[:SPLIT]] | upload:ID | a path (a .txt, .jsonl or .npy file, "
                    "or a directory of .txt files)")


class DataSourceError(ValueError):
    """A data source that is no source at all (not a string, empty): the message names the accepted forms."""


@dataclass(frozen=True)
class DataSource:
    """A parsed data source: `kind`, and `value`, the text after `KIND:` (a path: the whole text).
    `str(source)` is the text it was parsed from."""

    kind: SourceKind
    value: str

    def __str__(self) -> str:
        return self.value if self.kind == "path" else f"{self.kind}:{self.value}"

    @property
    def hf_parts(self) -> tuple[str, ...]:
        """hf:OWNER/NAME[:CONFIG[:SPLIT]] as its ':'-separated parts (dataset id first), as written."""
        if self.kind != "hf":
            raise DataSourceError(f"source {str(self)!r} is not a hub dataset (hf:OWNER/NAME[:CONFIG[:SPLIT]])")
        return tuple(self.value.split(":"))

    @property
    def dataset(self) -> str:
        """An hf: source's dataset id (OWNER/NAME), without its config and split."""
        return self.hf_parts[0]


def parse_data_source(text: str) -> DataSource:
    """A source's text → its DataSource; DataSourceError, naming the accepted forms, for one that is not a
    non-empty string."""
    if not isinstance(text, str):
        raise DataSourceError(f"a data source must be a string, got {type(text).__name__}; accepted: "
                              f"{ACCEPTED_SOURCES}")
    if not text:
        raise DataSourceError(f"a data source must not be empty; accepted: {ACCEPTED_SOURCES}")
    head, sep, rest = text.partition(":")
    for kind in PREFIXED:
        if sep and head == kind:
            return DataSource(kind, rest)
    return DataSource("path", text)


def is_upload(ref: str) -> bool:
    """Whether a source or a model id names an upload (`upload:ID`)."""
    return isinstance(ref, str) and bool(ref) and parse_data_source(ref).kind == "upload"

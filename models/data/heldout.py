"""Held-out data: which part of which text calibration, training and evaluation each read.

Held out is decided on what the data specs resolve to, never on how they are spelt: a source's
identity is the content hash of the file(s) it names (`corpus:shakespeare`, `./x.txt` and a data-root
copy of the same file are one text), or, for `hf:` sources, the normalised dataset, config and split;
what a spec reads of it is a range of the token stream, [skip_blocks·seq_len, (skip_blocks+sequences)·seq_len)
(rows for a 2-D `.npy`). Blocks always come from the start of the stream (`models.data.calibration`), so
ranges of the same identity are comparable whatever their block length.

Placement, as in the paper (appendix: the first 64 blocks are reserved for calibration): when training
shares a text with calibration it starts after the calibration blocks, and evaluation starts after
both; the specs are used as given only when the user allows overlap, and any overlap left is reported.
Torch-free.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from models.data.calibration import CalibrationSpec, DataError
from models.data.source import parse_data_source
from models.io.assets import AssetNotFoundError, corpus_file
from models.io.digest import sha256_file

_HASH_CHUNK = 1 << 20
_hash_cache: dict[tuple[str, int, int], str] = {}


def _file_sha256(path: Path) -> str:
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _hash_cache:
        _hash_cache[key] = sha256_file(path, _HASH_CHUNK)
    return _hash_cache[key]


def forget_hashes() -> None:
    """Drop the cached content hashes (a service worker, between jobs of different tenants)."""
    _hash_cache.clear()


def _is_rows(source: str) -> bool:
    """A 2-D `.npy` of blocks: its stream depends on seq_len, so ranges count rows, not tokens."""
    if not source.endswith(".npy") or not Path(source).is_file():
        return False
    try:
        return np.load(source, mmap_mode="r", allow_pickle=False).ndim == 2
    except (OSError, ValueError):
        return False


def source_identity(source: str, text_field: str = "text") -> str:
    """What text a source is, independent of its spelling: `sha256:…` of its content, or `hf:…`."""
    parsed = parse_data_source(source)
    if parsed.kind == "hf":
        parts = [*parsed.hf_parts, "", ""][:3]
        return f"hf:{parts[0]}:{parts[1]}:{parts[2] or 'train'}#{text_field}"
    try:
        path = corpus_file(parsed.value) if parsed.kind == "corpus" else Path(source)
    except AssetNotFoundError as exc:
        raise DataError(str(exc)) from exc
    try:
        if path.is_dir():
            digest = hashlib.sha256()
            for f in sorted(path.rglob("*.txt")):
                digest.update(f"{f.relative_to(path).as_posix()}\0{_file_sha256(f)}\n".encode())
            return f"sha256-dir:{digest.hexdigest()}"
        content = _file_sha256(path)
    except OSError as exc:
        raise DataError(f"source {source!r}: cannot read it to tell which text it is: {exc}") from exc
    field = f"#{text_field}" if path.suffix == ".jsonl" else ""
    return f"sha256:{content}{field}"


@dataclass(frozen=True)
class Part:
    """One spec of a run (calibration, train or eval), with what it resolved to."""

    name: str
    spec: CalibrationSpec
    identity: str
    rows: bool  # ranges count rows of a 2-D .npy instead of tokens

    @property
    def unit(self) -> int:
        return 1 if self.rows else self.spec.seq_len

    @property
    def span(self) -> tuple[int, int]:
        """[start, end) of the stream this part reads, in tokens (or rows)."""
        s = self.spec
        return s.skip_blocks * self.unit, (s.skip_blocks + s.sequences) * self.unit

    def same_text(self, other: Part) -> bool:
        return self.identity == other.identity and self.rows == other.rows

    def overlap(self, other: Part) -> int:
        if not self.same_text(other):
            return 0
        (a0, a1), (b0, b1) = self.span, other.span
        return max(0, min(a1, b1) - max(a0, b0))

    def after(self, end: int) -> Part:
        """This part moved to start at or after position `end` of the stream."""
        skip = -(-end // self.unit)
        return replace(self, spec=replace(self.spec, skip_blocks=max(self.spec.skip_blocks, skip)))

    def as_dict(self) -> dict[str, Any]:
        start, end = self.span
        return {"identity": self.identity, "unit": "rows" if self.rows else "tokens", "start": start, "end": end,
                "skip_blocks": self.spec.skip_blocks, "sequences": self.spec.sequences, "seq_len": self.spec.seq_len}


def part(name: str, spec: CalibrationSpec, identity: str | None = None) -> Part:
    return Part(name, spec, identity or source_identity(spec.source, spec.text_field), _is_rows(spec.source))


@dataclass(frozen=True)
class Placement:
    """Where training and evaluation read, after held-out placement, and what still overlaps."""

    train: CalibrationSpec | None
    eval: CalibrationSpec
    parts: tuple[Part, ...]
    moved: tuple[dict[str, Any], ...]
    overlaps: tuple[dict[str, Any], ...]
    allow_overlap: bool

    def as_dict(self) -> dict[str, Any]:
        """For summary.json / report.json: identities (content hashes, never server paths) and ranges."""
        return {"allow_overlap": self.allow_overlap, "parts": {p.name: p.as_dict() for p in self.parts},
                "moved": list(self.moved), "overlaps": list(self.overlaps), "held_out": not self.overlaps}


def _overlaps(parts: list[Part]) -> list[dict[str, Any]]:
    out = []
    for i, a in enumerate(parts):
        for b in parts[i + 1:]:
            if n := a.overlap(b):
                out.append({"parts": [a.name, b.name], "unit": "rows" if a.rows else "tokens", "overlap": n,
                            "of": [a.span[1] - a.span[0], b.span[1] - b.span[0]]})
    return out


def place(train: CalibrationSpec | None, evaluation: CalibrationSpec, *, calibration: CalibrationSpec | None = None,
          calibration_identity: str | None = None, allow_overlap: bool = False) -> Placement:
    """Training after the calibration blocks, evaluation after both, where they share a text.

    train: None for an evaluation alone (`eval --from`). calibration_identity: the identity recorded
    when the calibration ran (report.json), when its source string may no longer resolve here. With
    allow_overlap the specs are kept as given.
    """
    cal = None
    if calibration is not None:
        try:
            cal = part("calibration", calibration, calibration_identity)
        except DataError:  # an old report's source that no longer resolves here: it matches no other text
            cal = Part("calibration", calibration, f"unresolved:{calibration.source}", False)
    tr = part("train", train) if train is not None else None
    ev = part("eval", evaluation)
    moved: list[dict[str, Any]] = []
    if not allow_overlap:
        if cal is not None and tr is not None and tr.overlap(cal):
            moved.append({"part": "train", "skip_blocks": [tr.spec.skip_blocks, tr.after(cal.span[1]).spec.skip_blocks],
                          "why": "the calibration blocks of the same text are reserved"})
            tr = tr.after(cal.span[1])
        given = ev.spec.skip_blocks
        earlier = [p for p in (cal, tr) if p is not None]
        while clash := [p for p in earlier if ev.overlap(p)]:  # moves forward only: ends
            ev = ev.after(max(p.span[1] for p in clash))
        if ev.spec.skip_blocks != given:
            moved.append({"part": "eval", "skip_blocks": [given, ev.spec.skip_blocks],
                          "why": "evaluation is held out from the calibration and training text"})
    parts = [p for p in (cal, tr, ev) if p is not None]
    return Placement(train=tr.spec if tr is not None else None, eval=ev.spec, parts=tuple(parts), moved=tuple(moved),
                     overlaps=tuple(_overlaps(parts)), allow_overlap=allow_overlap)


def describe_dict(data: dict[str, Any]) -> list[str]:
    """One line per move or overlap of a placement's `as_dict()`, for a command's output."""
    lines = [f"{m['part']}: skip_blocks {m['skip_blocks'][0]} → {m['skip_blocks'][1]} ({m['why']})"
             for m in data.get("moved", [])]
    lines += [f"overlap (allowed): {o['parts'][0]} and {o['parts'][1]} share {o['overlap']} {o['unit']}"
              for o in data.get("overlaps", [])]
    return lines

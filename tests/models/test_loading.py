"""Model sources: hub ids (exercised offline through a Hugging Face cache laid out on disk), local
directories, and refusals."""

from __future__ import annotations

import pytest
import torch

from models.families import UnsupportedModelError
from models.io.loading import ModelLoadError, ModelSource, load_config, load_model
from tests.tiny import tiny_model, tokens


@pytest.mark.parametrize("bad", ["owner/../x", "not a hub id", "a/b/c", "-owner/name", "owner/"])
def test_malformed_hub_ids_are_refused(bad):
    with pytest.raises(ModelLoadError, match="hub id"):
        ModelSource(bad).resolved()


def test_bad_revision_and_gguf_name():
    with pytest.raises(ModelLoadError, match="revision"):
        ModelSource("owner/name", revision="../main").resolved()
    with pytest.raises(ModelLoadError, match="gguf_file"):
        ModelSource("owner/name", gguf_file="../x.gguf").resolved()
    with pytest.raises(ModelLoadError, match="does not exist"):
        ModelSource("/nowhere/model.gguf").resolved()


def test_hub_id_loads_from_the_hf_cache_offline(tmp_path, monkeypatch):
    """The real hub code path (`from_pretrained("owner/name", revision=...)`), served by a cache laid out
    as huggingface_hub writes it, with the network switched off."""
    model = tiny_model("qwen3")
    snapshot = tmp_path / "hub" / "models--acme--tiny-qwen3" / "snapshots" / "0123456789abcdef"
    model.save_pretrained(snapshot)
    refs = snapshot.parent.parent / "refs"
    refs.mkdir()
    (refs / "main").write_text("0123456789abcdef")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as hub_constants

    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    source = ModelSource("acme/tiny-qwen3", revision="main")
    assert load_config(source).model_type == "qwen3"
    loaded = load_model(source, device="cpu")
    ids = tokens()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits)


def test_local_directory_without_safetensors_is_refused(tmp_path):
    model = tiny_model("llama")
    model.save_pretrained(tmp_path / "m")
    for f in (tmp_path / "m").glob("*.safetensors"):
        f.unlink()
    torch.save(model.state_dict(), tmp_path / "m" / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match="only safetensors"):
        load_model(ModelSource(str(tmp_path / "m")))


def test_unsupported_architecture_is_refused_before_weights(tmp_path):
    model = tiny_model("llama")
    model.save_pretrained(tmp_path / "m")
    config = (tmp_path / "m" / "config.json").read_text().replace('"silu"', '"gelu"')
    (tmp_path / "m" / "config.json").write_text(config)
    with pytest.raises(UnsupportedModelError, match="hidden_act='gelu'"):
        load_config(ModelSource(str(tmp_path / "m")))


def test_a_tokenizer_that_panics_while_loading_is_a_model_load_error(tmp_path, monkeypatch):
    """pyo3's PanicException derives from BaseException: escaping as it is, it would pass the worker's
    `except Exception` and kill the process on every attempt; it becomes a ModelLoadError (a ValueError)."""
    import models.io.loading
    from models.io.loading import load_tokenizer

    class PanicException(BaseException):  # the name pyo3 gives it; the class is not importable
        pass

    def panics(*_args, **_kwargs):
        raise PanicException("called `Result::unwrap()` on an `Err` value")

    tiny_model("llama").save_pretrained(tmp_path)
    monkeypatch.setattr(models.io.loading.AutoTokenizer, "from_pretrained", panics)
    with pytest.raises(ModelLoadError, match="PanicException: called `Result::unwrap"):
        load_tokenizer(ModelSource(str(tmp_path)))

    def interrupted(*_args, **_kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(models.io.loading.AutoTokenizer, "from_pretrained", interrupted)
    with pytest.raises(KeyboardInterrupt):  # any other BaseException goes on as it was
        load_tokenizer(ModelSource(str(tmp_path)))

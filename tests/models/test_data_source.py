"""models/data/source.py: a data source's text parsed once into its kind and value; a text that is no source
refused naming the accepted forms."""

from __future__ import annotations

import subprocess
import sys

import pytest

from models.data.source import ACCEPTED_SOURCES, DataSource, DataSourceError, is_upload, parse_data_source


@pytest.mark.parametrize(("text", "kind", "value"), [
    ("corpus:shakespeare", "corpus", "shakespeare"),
    ("hf:Salesforce/wikitext:wikitext-2-raw-v1:test", "hf", "Salesforce/wikitext:wikitext-2-raw-v1:test"),
    ("upload:0123abcd", "upload", "0123abcd"),
    ("calibration/tokens.npy", "path", "calibration/tokens.npy"),
    ("/abs/dir", "path", "/abs/dir"),
    ("corpusx:name", "path", "corpusx:name"),  # only the exact prefixes name a kind
    ("./hf:odd.txt", "path", "./hf:odd.txt"),
])
def test_each_form_parses_to_its_kind_and_prints_back(text, kind, value):
    source = parse_data_source(text)
    assert source == DataSource(kind, value)
    assert str(source) == text


def test_an_hf_source_gives_its_dataset_and_parts():
    source = parse_data_source("hf:owner/name:config:split")
    assert source.dataset == "owner/name" and source.hf_parts == ("owner/name", "config", "split")
    assert parse_data_source("hf:owner/name").hf_parts == ("owner/name",)
    with pytest.raises(DataSourceError, match=r"not a hub dataset \(hf:OWNER/NAME"):
        _ = parse_data_source("corpus:kjv").dataset


@pytest.mark.parametrize("bad", ["", None, 3, ["corpus:kjv"]])
def test_a_text_that_is_no_source_is_refused_naming_the_forms(bad):
    with pytest.raises(DataSourceError) as caught:
        parse_data_source(bad)
    message = str(caught.value)
    assert "accepted: " + ACCEPTED_SOURCES in message
    for form in ("corpus:NAME", "hf:OWNER/NAME[:CONFIG[:SPLIT]]", "upload:ID", "a path"):
        assert form in message
    assert isinstance(caught.value, ValueError)  # the services' and the CLI's ValueError handlers catch it


def test_is_upload_for_sources_and_model_ids():
    assert is_upload("upload:abc") and not is_upload("Qwen/Qwen2.5-0.5B") and not is_upload("corpus:kjv")
    assert not is_upload("") and not is_upload(None)  # type: ignore[arg-type]


def test_the_parser_imports_no_torch():
    """The API process imports it (app/core/services): it must stay torch-free."""
    code = ("import sys; import models.data.source; "
            "print(sorted(m for m in ('torch', 'numpy', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"

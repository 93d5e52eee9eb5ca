"""The GGUF reader's tensor table and metadata bounds (issue 41): the table read by models.io.gguf_header
agrees with gguf-py's reader (an independent implementation) on a real file, the ggml block sizes agree
with gguf-py's, a tensor the config has no place for is refused before any loader sees it (transformers'
loader would dequantise it before dropping it: shown here), and the metadata arrays together are capped
before a string of them is walked."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from models.io.assets import smollm2_gguf
from models.io.gguf_header import GGUFError, GGUFLimits, read_header
from models.io.gguf_tensors import GGML_TYPES, checked_config
from tests.hostile_kit import gguf, gguf_array, gguf_string

gguf_py = pytest.importorskip("gguf")


def rewrite(source: Path, out: Path, *, extra: dict[str, tuple[np.ndarray, Any]] | None = None,
            arrays: dict[str, list[str]] | None = None, drop: str | None = None) -> Path:
    """`source` (a GGUF) written again by gguf-py with `extra` tensors (name → (float data, or uint8
    blocks already in the type, ggml type)),
    extra string arrays, and the tensor `drop` left out."""
    reader = gguf_py.GGUFReader(str(source))
    writer = gguf_py.GGUFWriter(str(out), str(reader.fields["general.architecture"].contents()))
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        writer.add_key_value(key, field.contents(), field.types[0], field.types[-1] if len(field.types) > 1 else None)
    for key, values in (arrays or {}).items():
        writer.add_array(key, values)
    for t in reader.tensors:
        if t.name != drop:
            writer.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
    for name, (data, qtype) in (extra or {}).items():
        raw = data if data.dtype == np.uint8 else gguf_py.quants.quantize(data, qtype)  # uint8: already its blocks
        writer.add_tensor(name, raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def config_of(path: Path, limits: GGUFLimits | None = None) -> dict[str, Any]:
    data = path.read_bytes()
    return checked_config(read_header(data, limits=limits), file_size=len(data))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from tests.tiny import tiny_gguf

    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    tiny_gguf(path)
    return path


def test_the_tensor_table_agrees_with_gguf_py_on_the_packaged_smollm2():
    path = smollm2_gguf()
    data = path.read_bytes()
    header = read_header(data)
    theirs = gguf_py.GGUFReader(str(path))
    assert [(t.name, t.dims, t.type, header.data_start + t.offset) for t in header.tensors] == [
        (t.name, tuple(int(n) for n in t.shape), int(t.tensor_type), t.data_offset) for t in theirs.tensors]
    assert config_of(path)["num_hidden_layers"] == 30  # a real file passes its own check


def test_ggml_block_sizes_are_gguf_pys():
    for type_id, (name, block, size) in GGML_TYPES.items():
        quant = gguf_py.GGMLQuantizationType(type_id)
        assert (quant.name, *gguf_py.GGML_QUANT_SIZES[quant]) == (name, block, size)


def test_an_extra_tensor_is_refused_though_the_loader_would_dequantise_it(tiny, tmp_path, monkeypatch):
    """The issue's case at 1/4096 scale: an extra Q2_K tensor the llama layout has no name for."""
    junk = np.zeros((256, 84), dtype=np.uint8)  # 256 rows of one 256-element Q2_K block (gguf-py cannot quantise it)
    hostile = rewrite(tiny, tmp_path / "extra.gguf",
                      extra={"blk.0.extra.weight": (junk, gguf_py.GGMLQuantizationType.Q2_K)})
    with pytest.raises(GGUFError, match=r"tensor 'blk\.0\.extra\.weight' is not one a llama model of 3 layers has"):
        config_of(hostile)
    # Why it is refused, not skipped: transformers dequantises every tensor of the table (`from gguf
    # import dequantize` when it loads) before it drops the ones it has no name for.
    from transformers import AutoModelForCausalLM

    original, dequantised = gguf_py.dequantize, []

    def recording(data: Any, qtype: Any) -> Any:
        out = original(data, qtype)
        dequantised.append(tuple(out.shape))
        return out

    monkeypatch.setattr(gguf_py, "dequantize", recording)
    AutoModelForCausalLM.from_pretrained(str(hostile.parent), gguf_file=hostile.name)
    assert (256, 256) in dequantised


@pytest.mark.parametrize(("case", "match"), [
    ("shape", r"tensor 'blk\.1\.ffn_up\.weight' has shape \[64, 512\]"),
    ("missing", r"lacks tensor .blk\.2\.attn_v\.weight., which its config needs"),
    ("outside", r"are not inside the file"),
])
def test_a_tensor_of_the_wrong_shape_a_missing_one_or_one_past_the_end_is_refused(tiny, tmp_path, case, match):
    if case == "shape":  # a layer 4× wider than the config: the loader would allocate what the limits never saw
        wide = np.ones((512, 64), dtype=np.float32)
        hostile = rewrite(tiny, tmp_path / "x.gguf", drop="blk.1.ffn_up.weight",
                          extra={"blk.1.ffn_up.weight": (wide, gguf_py.GGMLQuantizationType.F32)})
    elif case == "missing":
        hostile = rewrite(tiny, tmp_path / "x.gguf", drop="blk.2.attn_v.weight")
    else:
        hostile = tmp_path / "x.gguf"
        hostile.write_bytes(tiny.read_bytes()[:-64])  # the last tensor's data cut short
    with pytest.raises(GGUFError, match=match):
        config_of(hostile)


def test_metadata_arrays_together_are_capped_before_their_strings_are_walked(tiny, tmp_path):
    # the issue's file: one array of 2^21 empty strings (17 MB), within the per-array limit
    many = gguf([gguf_array("x.junk", 8, 1 << 21, gguf_string(b"") * (1 << 21))])
    with pytest.raises(GGUFError, match=r"declares 2097152 elements, past the 1048576 all its metadata arrays "
                                        r"together may hold .*DTP_LAYOUT_GGUF_MAX_METADATA_ITEMS"):
        read_header(many)
    # four arrays each within the per-array limit: the total is what is capped
    limits = GGUFLimits(max_array_items=1000, max_metadata_items=1500)
    split = rewrite(tiny, tmp_path / "split.gguf", arrays={"x.a": [""] * 600, "x.b": ["b"] * 600,
                                                          "x.c": [""] * 600})
    with pytest.raises(GGUFError, match=r"'x\.c' declares 600 elements, past the 1500 .*\(1200 before it"):
        config_of(split, limits)
    assert config_of(split, GGUFLimits(max_metadata_items=1800))["num_hidden_layers"] == 3


def test_a_tensor_entry_is_read_with_its_endianness():
    entry = gguf_string(b"token_embd.weight") + struct.pack("<I2QIQ", 2, 64, 96, 0, 0)
    head = gguf([gguf_string(b"general.architecture") + struct.pack("<I", 8) + gguf_string(b"llama")], tensors=1)
    header = read_header(head + entry)
    assert header.tensors[0].dims == (64, 96) and header.tensors[0].type == 0


@pytest.mark.serial  # a wall-time bound (< 1 s)
def test_a_header_declaring_2e32_layers_costs_what_its_table_holds(tiny):
    """The layout is looked up by name, never listed: 2^32 - 1 declared layers over a 3-layer table is
    refused in milliseconds, naming the first layer it lacks."""
    import time

    key = gguf_string(b"llama.block_count") + struct.pack("<I", 4)
    data = tiny.read_bytes().replace(key + struct.pack("<I", 3), key + struct.pack("<I", (1 << 32) - 1))
    t0 = time.perf_counter()
    with pytest.raises(GGUFError, match=r"lacks tensor 'blk\.3\.attn_norm\.weight'"):
        checked_config(read_header(data), file_size=len(data))
    assert time.perf_counter() - t0 < 1.0

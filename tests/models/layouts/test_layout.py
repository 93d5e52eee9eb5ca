"""Layouts: construction, balance, serialisation and the errors for malformed ones."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from models.base.layout_format import LAYOUT_FORMAT, LayoutError
from models.layouts.layout import (
    Layout,
    ModelShape,
    check_delta,
    check_devices,
    contiguous,
    from_json_dict,
    load,
    random,
)

SHAPE = ModelShape("llama", num_layers=3, num_kv_groups=4, num_query_heads=8, intermediate_size=96,
                   hidden_size=48, head_dim=6)


def _counts(arr: np.ndarray, devices: int) -> np.ndarray:
    """[N, W] device ids -> [N, L] units per device."""
    return np.stack([np.bincount(row, minlength=devices) for row in arr])


@pytest.mark.parametrize("devices", [1, 2, 4])
def test_contiguous_is_balanced_and_in_storage_order(devices: int) -> None:
    layout = contiguous(SHAPE, devices, delta=1)
    assert layout.kv_group_device.shape == (3, 4)
    assert layout.neuron_device.shape == (3, 96)
    for i in range(SHAPE.num_layers):
        # Group g sits on device g // (G/L), neuron k on k // (I/L): storage order sliced in L shards.
        assert layout.kv_group_device[i].tolist() == [g // (4 // devices) for g in range(4)]
        assert layout.neuron_device[i].tolist() == [k // (96 // devices) for k in range(96)]
        assert layout.group_order(i).tolist() == list(range(4))
        assert layout.neuron_order(i).tolist() == list(range(96))
    assert (_counts(layout.kv_group_device, devices) == 4 // devices).all()
    assert (_counts(layout.neuron_device, devices) == 96 // devices).all()


def test_layout_arrays_are_read_only() -> None:
    layout = contiguous(SHAPE, 2)
    with pytest.raises(ValueError):
        layout.kv_group_device[0, 0] = 1
    with pytest.raises(ValueError):
        layout.neuron_device[0, 0] = 1


@pytest.mark.parametrize("devices", [2, 4])
def test_random_is_balanced_and_seeded(devices: int) -> None:
    a, b = random(SHAPE, devices, 1, seed=3), random(SHAPE, devices, 1, seed=3)
    c = random(SHAPE, devices, 1, seed=4)
    assert (_counts(a.kv_group_device, devices) == 4 // devices).all()
    assert (_counts(a.neuron_device, devices) == 96 // devices).all()
    np.testing.assert_array_equal(a.kv_group_device, b.kv_group_device)
    np.testing.assert_array_equal(a.neuron_device, b.neuron_device)
    assert not np.array_equal(a.neuron_device, c.neuron_device)
    # Layers are drawn independently, not one row repeated.
    assert not np.array_equal(a.neuron_device[0], a.neuron_device[1])
    # And a random layout is (with overwhelming probability) not the contiguous one.
    assert not np.array_equal(a.neuron_device, contiguous(SHAPE, devices).neuron_device)
    assert a.name == "random-3"


def test_random_is_roughly_uniform() -> None:
    """Over many seeds every unit lands on every device with frequency ~1/L (chi-square bound)."""
    shape = ModelShape("llama", num_layers=2, num_kv_groups=4, num_query_heads=8, intermediate_size=8)
    devices, seeds = 2, 2000
    group_hits = np.zeros((2, 4, devices))
    neuron_hits = np.zeros((2, 8, devices))
    pairs_together = np.zeros((8, 8))
    for seed in range(seeds):
        layout = random(shape, devices, 1, seed)
        for i in range(2):
            group_hits[i, np.arange(4), layout.kv_group_device[i]] += 1
            neuron_hits[i, np.arange(8), layout.neuron_device[i]] += 1
        row = layout.neuron_device[0]
        pairs_together += row[:, None] == row[None, :]
    for hits in (group_hits, neuron_hits):
        expected = seeds / devices
        chi2 = ((hits - expected) ** 2 / expected).sum(-1)  # per unit, 1 degree of freedom
        assert chi2.max() < 15.0, chi2  # P(chi2_1 > 15) ~ 1e-4 per unit
    # Balanced uniform: a given other neuron shares the device with prob (I/L - 1) / (I - 1) = 3/7.
    off = pairs_together[~np.eye(8, dtype=bool)] / seeds
    np.testing.assert_allclose(off, 3 / 7, atol=0.05)


@pytest.mark.parametrize(
    "shape_kwargs, devices, named, not_named, valid",
    [
        (dict(num_kv_groups=4, intermediate_size=96), 3, ["num_kv_groups=4"], ["intermediate_size"],
         "1, 2, 4"),
        (dict(num_kv_groups=4, intermediate_size=90), 4, ["intermediate_size=90"], ["num_kv_groups="],
         "1, 2"),
        (dict(num_kv_groups=6, intermediate_size=90), 4, ["num_kv_groups=6", "intermediate_size=90"], [],
         "1, 2, 3, 6"),
    ],
)
def test_divisibility_error_names_field_and_valid_counts(shape_kwargs: dict[str, int], devices: int,
                                                         named: list[str], not_named: list[str],
                                                         valid: str) -> None:
    shape = ModelShape("llama", num_layers=2, num_query_heads=12, **shape_kwargs)
    for build in (lambda: check_devices(shape, devices), lambda: contiguous(shape, devices),
                  lambda: random(shape, devices, 1, 0)):
        with pytest.raises(LayoutError) as info:
            build()
        msg = str(info.value)
        assert f"L={devices}" in msg
        for field in named:
            assert field in msg, msg
        for field in not_named:
            assert field not in msg.split(";")[0], msg
        assert msg.endswith(f"valid L for this model: {valid}"), msg


@pytest.mark.parametrize("devices", [0, -2, 2.0, "2"])
def test_devices_must_be_positive_int(devices: Any) -> None:
    with pytest.raises(LayoutError, match="positive integer"):
        check_devices(SHAPE, devices)


@pytest.mark.parametrize("delta", [-1, 4, 1.0])
def test_delta_range(delta: Any) -> None:
    with pytest.raises(LayoutError, match=r"delta must be an integer in \[0, num_layers=3\]"):
        check_delta(SHAPE, delta)
    with pytest.raises(LayoutError, match="delta"):
        contiguous(SHAPE, 2, delta)


@pytest.mark.parametrize("delta", [0, 1, 3])
def test_delta_in_range_is_accepted(delta: int) -> None:
    check_delta(SHAPE, delta)
    assert contiguous(SHAPE, 2, delta).delta == delta


@pytest.mark.parametrize("score", [None, {"fo": 12.5, "sweeps": 3}])
def test_json_round_trip_is_exact(tmp_path: Path, score: dict[str, Any] | None) -> None:
    layout = random(SHAPE, 4, delta=2, seed=11).with_name("opt", score=score)
    path = tmp_path / "sub" / "layout.json"
    layout.save(path)
    assert not path.with_name("layout.json.tmp").exists()
    assert json.loads(path.read_text())["format"] == LAYOUT_FORMAT
    back = load(path)
    assert back.name == "opt" and back.devices == 4 and back.delta == 2
    assert back.shape == SHAPE
    assert back.score == score
    np.testing.assert_array_equal(back.kv_group_device, layout.kv_group_device)
    np.testing.assert_array_equal(back.neuron_device, layout.neuron_device)
    assert back.kv_group_device.dtype == np.int64
    assert back.to_json_dict() == layout.to_json_dict()


def _good_dict() -> dict[str, Any]:
    return random(SHAPE, 2, 1, seed=5).to_json_dict()


def _write(tmp_path: Path, data: Any) -> Path:
    path = tmp_path / "bad.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def _load_error(tmp_path: Path, data: Any) -> str:
    path = _write(tmp_path, data)
    with pytest.raises(LayoutError) as info:
        load(path)
    msg = str(info.value)
    assert msg.startswith(str(path)), msg  # every message says which file
    return msg


def test_wrong_format_string_is_rejected(tmp_path: Path) -> None:
    data = _good_dict()
    data["format"] = "dtp-layout/2"
    msg = _load_error(tmp_path, data)
    assert "'format'" in msg and "'dtp-layout/1'" in msg and "'dtp-layout/2'" in msg


@pytest.mark.parametrize("key", ["devices", "delta", "model", "kv_group_device", "neuron_device"])
def test_missing_field_is_rejected(tmp_path: Path, key: str) -> None:
    data = _good_dict()
    del data[key]
    assert f"missing field {key!r}" in _load_error(tmp_path, data)


@pytest.mark.parametrize("key", ["model_type", "num_layers", "num_kv_groups", "num_query_heads",
                                 "intermediate_size"])
def test_missing_model_field_is_rejected(tmp_path: Path, key: str) -> None:
    data = _good_dict()
    del data["model"][key]
    assert f"missing field 'model.{key}'" in _load_error(tmp_path, data)


def test_unbalanced_layer_is_rejected(tmp_path: Path) -> None:
    data = _good_dict()
    row = data["neuron_device"][1]
    row[row.index(0)] = 1  # one neuron moved from device 0 to device 1 in layer 1
    msg = _load_error(tmp_path, data)
    assert "neuron_device[1]" in msg and "unbalanced" in msg and "[47, 49]" in msg


def test_device_id_out_of_range_is_rejected(tmp_path: Path) -> None:
    data = _good_dict()
    data["kv_group_device"][2] = [0, 1, 2, 1]
    msg = _load_error(tmp_path, data)
    assert "kv_group_device[2]" in msg and "[0, 1]" in msg and "0..2" in msg
    data["kv_group_device"][2] = [0, -1, 1, 1]
    assert "kv_group_device[2]" in _load_error(tmp_path, data)


@pytest.mark.parametrize(
    "field, value, expected",
    [
        ("kv_group_device", [[0, 1, 0, 1]] * 2, "[3, 4]"),  # one layer missing
        ("kv_group_device", [[0, 1, 0, 1, 0, 1]] * 3, "[3, 4]"),  # too many groups
        ("neuron_device", [0, 1] * 48, "[3, 96]"),  # flat instead of [N, I]
    ],
)
def test_wrong_shape_is_rejected(tmp_path: Path, field: str, value: Any, expected: str) -> None:
    data = _good_dict()
    data[field] = value
    msg = _load_error(tmp_path, data)
    assert f"{field}: expected shape {expected}" in msg


def test_ragged_array_is_rejected(tmp_path: Path) -> None:
    data = _good_dict()
    data["neuron_device"][1] = data["neuron_device"][1][:-1]
    msg = _load_error(tmp_path, data)
    assert "neuron_device" in msg and "equal-length" in msg


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        (lambda d: d["kv_group_device"].__setitem__(0, [0.2, 1.9, 0.7, 1.0]),
         "kv_group_device: device ids must be integers"),
        (lambda d: d.__setitem__("delta", True), "field 'delta' must be an integer"),
        (lambda d: d.__setitem__("devices", 2.0), "field 'devices' must be an integer"),
        (lambda d: d["model"].__setitem__("num_layers", "3"),
         "field 'model.num_layers' must be a non-negative integer"),
        (lambda d: d["model"].__setitem__("model_type", 7), "field 'model.model_type' must be a string"),
    ],
)
def test_wrongly_typed_fields_are_rejected(tmp_path: Path, mutate: Any, expected: str) -> None:
    data = _good_dict()
    mutate(data)
    assert expected in _load_error(tmp_path, data)


@pytest.mark.parametrize("text", ["{not json", "", "[1, 2, 3]", "null"])
def test_non_json_or_non_object_is_rejected(tmp_path: Path, text: str) -> None:
    msg = _load_error(tmp_path, text)
    assert "JSON" in msg


def test_missing_file_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(LayoutError, match="cannot read layout JSON"):
        load(tmp_path / "nope.json")


def test_layout_constructor_validates() -> None:
    good = contiguous(SHAPE, 2)
    bad = good.neuron_device.copy()
    bad[0, :] = 0
    with pytest.raises(LayoutError, match=r"neuron_device\[0\]: unbalanced"):
        Layout("x", 2, 1, SHAPE, good.kv_group_device, bad)


def test_from_json_dict_names_source() -> None:
    with pytest.raises(LayoutError, match=r"^mysource: expected a JSON object"):
        from_json_dict([1], source="mysource")

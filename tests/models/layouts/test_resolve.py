"""The one resolver of layout names (models.layouts.resolve): export, eval, distill and the service use it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from models.base.layout_format import LayoutError
from models.families import model_shape
from models.layouts.layout import contiguous, random
from models.layouts.resolve import resolve_layout
from tests.tiny import tiny_config


def test_resolve_contiguous_and_random() -> None:
    shape = model_shape(tiny_config("llama"))
    c = resolve_layout("contiguous", shape=shape, devices=2, delta=1)
    np.testing.assert_array_equal(c.neuron_device, contiguous(shape, 2).neuron_device)
    for name in ("random:7", "random-7"):
        r = resolve_layout(name, shape=shape, devices=4, delta=2)
        assert r.name == "random-7" and r.devices == 4 and r.delta == 2
        np.testing.assert_array_equal(r.neuron_device, random(shape, 4, 2, 7).neuron_device)
        np.testing.assert_array_equal(r.kv_group_device, random(shape, 4, 2, 7).kv_group_device)


def test_resolve_path(tmp_path: Path) -> None:
    shape = model_shape(tiny_config("llama"))
    layout = random(shape, 2, 1, seed=9).with_name("saved")
    path = tmp_path / "l.json"
    layout.save(path)
    same = resolve_layout(str(path), shape=shape, devices=2, delta=1)
    assert same.name == "saved" and same.delta == 1
    np.testing.assert_array_equal(same.neuron_device, layout.neuron_device)
    # A different delta is taken from the request, the assignment from the file.
    other = resolve_layout(str(path), shape=shape, devices=2, delta=3)
    assert other.delta == 3
    np.testing.assert_array_equal(other.kv_group_device, layout.kv_group_device)


def test_names_of_an_optimise_output_win_and_keep_their_score(tmp_path: Path) -> None:
    shape = model_shape(tiny_config("llama"))
    layouts = tmp_path / "layouts"
    stored = random(shape, 2, 1, seed=42)
    stored.with_name("optimised", {"J": 4.5}).save(layouts / "optimised.json")
    stored.with_name("random-5", {"J": 1.0}).save(layouts / "random-5.json")  # not what seed 5 draws
    opt = resolve_layout("optimised", shape=shape, devices=2, delta=2, layouts_dir=layouts)
    assert opt.name == "optimised" and opt.score == {"J": 4.5} and opt.delta == 2
    np.testing.assert_array_equal(opt.neuron_device, stored.neuron_device)
    for name in ("random:5", "random-5"):  # one layout: the stored one, with its score
        got = resolve_layout(name, shape=shape, devices=2, delta=1, layouts_dir=layouts)
        assert got.name == "random-5" and got.score == {"J": 1.0}
        np.testing.assert_array_equal(got.neuron_device, stored.neuron_device)
    built = resolve_layout("random-6", shape=shape, devices=2, delta=1, layouts_dir=layouts)  # not stored
    np.testing.assert_array_equal(built.neuron_device, random(shape, 2, 1, 6).neuron_device)


def test_resolve_errors(tmp_path: Path) -> None:
    shape = model_shape(tiny_config("llama"))
    with pytest.raises(LayoutError, match="random:SEED"):
        resolve_layout("random:abc", shape=shape, devices=2, delta=1)
    with pytest.raises(LayoutError, match="no such file; expected 'contiguous', 'random:SEED'"):
        resolve_layout(str(tmp_path / "missing.json"), shape=shape, devices=2, delta=1)
    with pytest.raises(LayoutError, match="--from DIR"):
        resolve_layout("optimised", shape=shape, devices=2, delta=1)
    with pytest.raises(LayoutError, match="num_kv_groups=4"):
        resolve_layout("contiguous", shape=shape, devices=3, delta=1)
    with pytest.raises(LayoutError, match="delta"):
        resolve_layout("contiguous", shape=shape, devices=2, delta=4)
    path = tmp_path / "layouts" / "optimised.json"
    random(shape, 2, 1, seed=9).save(path)
    with pytest.raises(LayoutError, match=r"it has: optimised\)$"):
        resolve_layout("heads-only", shape=shape, devices=2, delta=1, layouts_dir=tmp_path / "layouts")
    for name in (str(path), "optimised"):
        with pytest.raises(LayoutError, match="devices=2, but the run asks for devices=4"):
            resolve_layout(name, shape=shape, devices=4, delta=1, layouts_dir=tmp_path / "layouts")
    other_shape = model_shape(tiny_config("llama", intermediate_size=64))
    with pytest.raises(LayoutError, match=r"model\.intermediate_size=96, the model has 64"):
        resolve_layout(str(path), shape=other_shape, devices=2, delta=1)
    qwen_shape = model_shape(tiny_config("qwen2"))
    with pytest.raises(LayoutError, match=r"model\.model_type=llama, the model has qwen2"):
        resolve_layout(str(path), shape=qwen_shape, devices=2, delta=1)

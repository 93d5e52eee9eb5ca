"""The xdist schedule's work units (tests/xdist_kit.py): a file is one unit, a `split_by_param` file one unit
per parameter set, a `serial` test the serial group whatever its file."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from tests import xdist_kit


def _item(nodeid: str, param: str | None, *marks: str) -> Any:
    return SimpleNamespace(nodeid=nodeid, callspec=None if param is None else SimpleNamespace(id=param),
                           get_closest_marker=lambda name: name if name in marks else None)


def test_a_split_file_is_one_unit_per_parameter_set_and_others_one_per_file() -> None:
    split = "tests/models/serving/test_vllm.py::test_greedy[llama-tp-shards]"
    assert xdist_kit.param_unit(_item(split, "llama-tp-shards", "split_by_param")) == \
        "tests/models/serving/test_vllm.py[llama-tp-shards]"
    assert xdist_kit.param_unit(_item(split, "llama-tp-shards")) is None  # not marked: its file
    assert xdist_kit.param_unit(_item("tests/x.py::test_a", None, "split_by_param")) is None  # no parameters
    assert xdist_kit.unit_of("tests/x.py::test_a[1]") == "tests/x.py"
    assert xdist_kit.unit_of("tests/x.py::test_a[1]@grp") == "grp"


def test_the_workers_lists_reach_the_schedule(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(xdist_kit, "WORKER", "gw0")
    run = xdist_kit.Run.__new__(xdist_kit.Run)
    run._shared = tmp_path
    items = [_item("tests/v.py::test_a[e1]", "e1", "split_by_param"), _item("tests/v.py::test_b[e2]", "e2",
                                                                              "split_by_param"),
             _item("tests/s.py::test_c", None, "serial"), _item("tests/p.py::test_d", None)]
    run.collected(items)
    assert run.param_units() == {"tests/v.py::test_a[e1]": "tests/v.py[e1]", "tests/v.py::test_b[e2]": "tests/v.py[e2]"}
    assert run.serial_ids() == {"tests/s.py::test_c"}

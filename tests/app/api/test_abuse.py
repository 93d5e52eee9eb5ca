"""The requests a hostile user would send, on the real Postgres (where a NUL or an integer past 64 bits
used to become a 500): crafted model configs, oversized and endless bodies, work past the budgets,
floods, integer overflows and control characters. Each gets a JSON 4xx naming the field, fast."""

from __future__ import annotations

import json
import os
import select
import socket
import statistics
import subprocess
import sys
import time
import uuid

import pytest
from fastapi.testclient import TestClient

from app.api.main import create_app
from app.core.db import Job, database, utcnow
from app.core.keys import create_key
from app.core.migrate import upgrade
from tests.service_kit import free_port, make_settings, own_prefix, provision, spec

pytestmark = [pytest.mark.postgres, pytest.mark.redis]


@pytest.fixture(scope="module")
def base(tmp_path_factory, postgres_server, redis_broker):
    """Keyword arguments of the settings: one migrated Postgres database, a broker prefix, the roots."""
    broker = redis_broker[0]
    root = tmp_path_factory.mktemp("abuse")
    kwargs = {"database_url": postgres_server.create_database("dtp_abuse"), "broker_url": broker,
              "broker_key_prefix": own_prefix(redis_broker, "abuse")}
    upgrade(kwargs["database_url"])
    provision(make_settings(root, **kwargs))
    admin = create_key(database(kwargs["database_url"]), name="abuse-admin", admin=True)
    return root, kwargs, admin


def app_with(base, **overrides):
    """A client of an app with these settings, sending the module's admin key unless told otherwise."""
    root, kwargs, admin = base
    return TestClient(create_app(make_settings(root, **kwargs, **overrides)), headers={"X-API-Key": admin})


def fields(response):
    assert response.headers["content-type"] == "application/json", response.text
    body = response.json()
    return {e["field"]: e["msg"] for e in body["detail"]} if isinstance(body["detail"], list) else {
        body["field"]: body["detail"]}


def crafted_model(settings, name, **config):
    folder = settings.models_dir / name
    folder.mkdir(parents=True, exist_ok=True)
    base_config = {"model_type": "llama", "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
                   "intermediate_size": 96, "hidden_size": 48, "vocab_size": 97, "max_position_embeddings": 256}
    (folder / "config.json").write_text(json.dumps({**base_config, **config}))
    return name


@pytest.mark.serial  # a latency bound (median < 0.1 s)
def test_crafted_configs_answer_422_in_milliseconds(base):
    """2^40 heads (a loop over the heads would never finish), 2^24 heads (0.77 s on main), and the
    largest accepted dimensions with an L that divides nothing (the valid L from the divisors of gcd)."""
    root, kwargs, _ = base
    settings = make_settings(root, **kwargs)
    cases = {
        crafted_model(settings, "heads-2e40", num_attention_heads=2**40, num_key_value_heads=2**40): "2^16",
        crafted_model(settings, "heads-2e24", num_attention_heads=2**24, num_key_value_heads=2**24): "2^16",
        crafted_model(settings, "layers-huge", num_hidden_layers=10**18): "num_hidden_layers",
        crafted_model(settings, "not-an-int", num_attention_heads="8" * 5000): "num_attention_heads",
        crafted_model(settings, "widest", num_attention_heads=2**16, num_key_value_heads=2**16,
                      intermediate_size=2**20 - 2**4, hidden_size=2**16, num_hidden_layers=1,
                      vocab_size=2): "valid L for this model: 1, 2, 4, 8, 16",
    }
    with app_with(base) as client:
        client.get("/v1/jobs")  # warm
        for model, text in cases.items():
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                r = client.post("/v1/jobs", json=spec(model={"id": model}, devices=3))
                times.append(time.perf_counter() - t0)
                assert r.status_code == 422, r.text
            problems = fields(r)
            assert text in (problems.get("model.id", "") + problems.get("devices", "")), problems
            print(f"{model}: 422 in {statistics.median(times) * 1e3:.1f} ms (median of 5)")
            assert statistics.median(times) < 0.1


def _serve(base, tmp_path):
    """The API under uvicorn in a subprocess (a real HTTP server, its own memory), on a free port."""
    root, kwargs, _ = base
    port = free_port()
    env = {**os.environ, **make_settings(root, **kwargs).worker_env()}
    log = open(tmp_path / "uvicorn.log", "wb")  # noqa: SIM115 (the subprocess's)
    proc = subprocess.Popen([sys.executable, "-m", "uvicorn", "app.api.main:create_app", "--factory",
                             "--host", "127.0.0.1",
                             "--port", str(port), "--log-level", "warning"], env=env, stdout=log, stderr=log)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc, port
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise TimeoutError((tmp_path / "uvicorn.log").read_text())


def _peak_rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


def _push(port: int, head: bytes, body_chunks, total: int) -> tuple[bytes, int, float]:
    """Send `head`, then body chunks until the server answers; (answer, body bytes sent, seconds)."""
    sock = socket.create_connection(("127.0.0.1", port))
    t0, sent, answer = time.perf_counter(), 0, b""
    try:
        sock.sendall(head)
        sock.setblocking(False)
        pending = b""
        while time.perf_counter() - t0 < 20:
            readable, writable, _ = select.select([sock], [sock] if sent < total else [], [], 1.0)
            if readable:
                data = sock.recv(65536)
                answer += data
                if not data or (b"\r\n\r\n" in answer and answer.rstrip().endswith(b"}")):
                    break
            elif writable:
                pending = pending or next(body_chunks, b"")
                try:
                    n = sock.send(pending)
                except (BrokenPipeError, ConnectionResetError):
                    break
                sent, pending = sent + n, pending[n:]
    finally:
        sock.close()
    return answer, sent, time.perf_counter() - t0


def test_a_100_mb_body_gets_413_without_being_buffered(base, tmp_path):
    proc, port = _serve(base, tmp_path)
    key = f"X-API-Key: {base[2]}\r\n"
    try:
        size, block = 100_000_000, b"x" * 65536
        before = _peak_rss_kib(proc.pid)
        head = (f"POST /v1/jobs HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n{key}"
                f"Content-Length: {size}\r\n\r\n").encode()
        answer, sent, seconds = _push(port, head, iter([block] * (size // len(block) + 1)), size)
        assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
        assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"] == "payload_too_large"
        print(f"Content-Length 100 MB: 413 after {seconds * 1e3:.1f} ms, {sent:,} body bytes sent")
        # Chunked, no length: counted as it arrives, refused once past 64 KiB.
        head = f"POST /v1/jobs HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n{key}" \
               "Transfer-Encoding: chunked\r\n\r\n".encode()
        chunk = b"%x\r\n%s\r\n" % (len(block), block)
        answer2, sent2, seconds2 = _push(port, head, iter([chunk] * (size // len(block) + 1)), size)
        assert answer2.startswith(b"HTTP/1.1 413"), answer2[:200]
        print(f"chunked 100 MB: 413 after {seconds2 * 1e3:.1f} ms, {sent2:,} body bytes sent")
        grown = _peak_rss_kib(proc.pid) - before
        print(f"server peak RSS grew by {grown} KiB")
        assert sent < 10_000_000 and sent2 < 10_000_000  # the server stopped reading; the socket buffers the rest
        assert grown < 16 * 1024
        assert seconds < 2 and seconds2 < 2
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_per_job_budgets_are_422_naming_the_field(base):
    distill = {"steps": 20_000, "recipe": {"batch_size": 1, "micro_batch_size": 1, "eval_every": 1}}
    cases = [
        ({"calibration": {"sequences": 100_000, "seq_len": 256}}, "calibration.sequences", "MAX_CALIBRATION_TOKENS"),
        ({"calibration": {"seq_len": 1_048_576}}, "calibration.seq_len", "max_position_embeddings=256"),
        ({"calibration": {"skip_blocks": 1_000_000, "seq_len": 256}}, "calibration.skip_blocks", "MAX_SKIP_TOKENS"),
        ({"calibration": {"skip_blocks": 10**18}}, "calibration.skip_blocks", "less than or equal"),
        ({"distill": {"steps": 10_000_000}}, "distill.steps", "MAX_DISTILL_TOKENS"),
        ({"distill": distill}, "distill.recipe.eval_every", "MAX_EVALUATIONS"),
        ({"distill": {"eval": {"source": "corpus:kjv", "sequences": 1_000_000}}}, "distill.eval.sequences",
         "MAX_CALIBRATION_TOKENS"),
        ({"distill": {"train": {"source": "corpus:kjv", "seq_len": 4096}}}, "distill.train.seq_len",
         "max_position_embeddings"),
        # no worker owns more GPUs than DTP_LAYOUT_MAX_WORLD_SIZE (1 by default): it could never start
        ({"distill": {"world_size": 2}}, "distill.world_size", "DTP_LAYOUT_MAX_WORLD_SIZE"),
        ({"distill": {"world_size": 65}}, "distill.world_size", "less than or equal"),
        ({"distill": {"world_size": 3}}, "distill", "must divide recipe.batch_size=16"),
    ]
    with app_with(base) as client:
        for overrides, field, text in cases:
            r = client.post("/v1/jobs", json=spec(**overrides))
            assert r.status_code == 422, (overrides, r.text)
            problems = fields(r)
            assert field in problems and text in problems[field], (field, problems)


# The reviewer's job of issue 17: a tiny training (9 998 steps of one 16-token sequence) evaluated after
# every step on 65 536 blocks of 16 tokens, all in one forward: 9 999 evaluations and the dense model's,
# each of 2²⁰ tokens, are 10¹⁰ forward tokens of evaluation, once accepted as 160 224 work tokens.
EVAL_HEAVY = {"layouts": ["optimised"], "steps": 9_998, "train": {"source": "calib/ids.npy", "seq_len": 16},
              "eval": {"source": "calib/ids.npy", "sequences": 65_536, "seq_len": 16},
              "recipe": {"batch_size": 1, "micro_batch_size": 1, "eval_every": 1, "eval_batch_size": 65_536}}


@pytest.mark.serial  # a latency bound (median < 0.1 s)
def test_every_unit_of_work_is_counted_at_submit(base):
    """Evaluation (every cadence, run and block) and layout work (optimiser starts, layouts scored)
    count in the job's work tokens: 10¹⁰ evaluation tokens are 422 naming DTP_LAYOUT_MAX_EVAL_TOKENS,
    fast; a job whose whole count no tenant may hold is 422 naming DTP_LAYOUT_MAX_ACTIVE_TOKENS."""
    from app.core.schemas.jobs import JobSpec
    from app.core.services.budgets import LAYOUT_SCORE_TOKENS, LAYOUT_START_TOKENS, job_work

    hostile = spec(random_layouts=0, ablations=False, export=False, distill=EVAL_HEAVY)
    work = job_work(JobSpec.model_validate(hostile))
    assert work.evaluations == 9_999 and work.evaluation == 10_000 * 65_536 * 16 > 10**10
    assert work.training == 9_998 * 16 and work.calibration == 8 * 32
    assert work.optimiser_starts == 5 and work.layouts_scored == 2  # optimised with 4 restarts; contiguous too
    assert work.tokens == work.calibration + work.training + work.evaluation + 5 * LAYOUT_START_TOKENS \
        + 2 * LAYOUT_SCORE_TOKENS
    with app_with(base) as client:
        client.get("/v1/jobs")  # warm
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            r = client.post("/v1/jobs", json=hostile)
            times.append(time.perf_counter() - t0)
            assert r.status_code == 422, r.text
        problems = fields(r)
        assert "DTP_LAYOUT_MAX_EVAL_TOKENS" in problems["distill.eval.sequences"], problems
        assert "(9,999 + 1) × 65,536 × 16" in problems["distill.eval.sequences"], problems
        print(f"10^10 evaluation tokens: 422 in {statistics.median(times) * 1e3:.1f} ms (median of 5)")
        assert statistics.median(times) < 0.1
    # Under every per-part budget, but more than a tenant may ever hold: waiting cannot help, so 422.
    layouts_only = spec(random_layouts=64, ablations=True, restarts=64)
    heavy = job_work(JobSpec.model_validate(layouts_only))
    assert heavy.optimiser_starts == 7 * 65 + 2 and heavy.layouts_scored == 1 + 8 + 1 + 64
    with app_with(base, max_active_tokens=heavy.tokens - 1) as client:
        r = client.post("/v1/jobs", json=layouts_only)
        assert r.status_code == 422, r.text
        assert "DTP_LAYOUT_MAX_ACTIVE_TOKENS" in fields(r)["restarts"] and "could never start" in fields(r)["restarts"]


def test_active_jobs_and_work_tokens_per_tenant_are_429_with_retry_after(base):
    from app.core.schemas.jobs import JobSpec
    from app.core.services.budgets import work_tokens

    # Work tokens of each job: its calibration and its layout work (one optimiser start, two layouts scored).
    small = spec(calibration={"sequences": 8, "seq_len": 32}, ablations=False, random_layouts=1, restarts=0)
    big = spec(calibration={"sequences": 128, "seq_len": 256}, ablations=False, random_layouts=1, restarts=0)
    small_tokens, big_tokens = (work_tokens(JobSpec.model_validate(s)) for s in (small, big))
    with app_with(base, max_active_jobs=2, max_active_tokens=small_tokens + big_tokens - 1) as client:
        db = client.app.state.db
        a = {"X-API-Key": create_key(db, name=f"a-{uuid.uuid4().hex[:8]}", tenant=f"t-{uuid.uuid4().hex[:8]}")}
        b = {"X-API-Key": create_key(db, name=f"b-{uuid.uuid4().hex[:8]}", tenant=f"u-{uuid.uuid4().hex[:8]}")}
        first = client.post("/v1/jobs", json=small, headers=a)
        assert first.status_code == 202, first.text
        assert client.post("/v1/jobs", json=small, headers=a).status_code == 202
        full = client.post("/v1/jobs", json=small, headers=a)
        assert full.status_code == 429 and int(full.headers["retry-after"]) >= 1
        assert fields(full) == {"X-API-Key": full.json()["detail"]} and "MAX_ACTIVE_JOBS=2" in full.json()["detail"]
        assert full.json()["error"] == "too_many_active_jobs"
        assert client.post("/v1/jobs", json=small, headers=b).status_code == 202  # another tenant is not held up
        assert client.post(f"/v1/jobs/{first.json()['id']}/cancel", headers=a).status_code == 202
        assert client.post("/v1/jobs", json=small, headers=a).status_code == 202  # a finished job frees a place
        # Work tokens: one small job in flight for b, and a big one more is over the budget by one.
        over = client.post("/v1/jobs", json=big, headers=b)
        assert over.status_code == 429 and "calibration.sequences" in fields(over)
        assert "MAX_ACTIVE_TOKENS" in over.json()["detail"] and over.headers["retry-after"]
        assert f"with this job's {big_tokens:,} (calibration 32,768 + " in over.json()["detail"]
        assert over.json()["error"] == "work_budget"
        # Evaluation counts in flight too: a distillation whose evaluation (3 × 768 × 16 tokens) is most of
        # its work, within the budget alone but not with b's small job.
        evaluated = spec(calibration={"sequences": 8, "seq_len": 32}, ablations=False, random_layouts=1, restarts=0,
                         export=False, distill={**EVAL_HEAVY, "steps": 1, "eval": {"source": "calib/ids.npy",
                                                                                    "sequences": 768, "seq_len": 16}})
        assert big_tokens < work_tokens(JobSpec.model_validate(evaluated)) <= small_tokens + big_tokens - 1
        over = client.post("/v1/jobs", json=evaluated, headers=b)
        assert over.status_code == 429 and "distill.eval.sequences" in fields(over), over.text


def test_rate_limit_per_key_is_429_with_retry_after(base):
    with app_with(base, rate_limit_per_min=60, rate_limit_burst=3) as client:
        db = client.app.state.db
        a = {"X-API-Key": create_key(db, name=f"ra-{uuid.uuid4().hex[:8]}")}
        b = {"X-API-Key": create_key(db, name=f"rb-{uuid.uuid4().hex[:8]}")}
        assert [client.get("/v1/jobs", headers=a).status_code for _ in range(3)] == [200, 200, 200]
        limited = client.get("/v1/jobs", headers=a)
        assert limited.status_code == 429 and limited.json()["field"] == "X-API-Key"
        assert limited.json()["error"] == "rate_limited"
        assert 1 <= int(limited.headers["retry-after"]) <= 2
        assert client.get("/v1/jobs", headers=b).status_code == 200  # per key
        # Requests without a valid key are limited per address: guessing keys is throttled too.
        codes = [client.get("/v1/jobs", headers={"X-API-Key": "nope"}).status_code for _ in range(4)]
        assert client.get("/v1/jobs", headers=b).status_code == 200
        assert codes == [401, 401, 401, 429]
        assert client.get("/healthz").status_code == 200


@pytest.mark.parametrize(("path", "params", "field"), [
    ("/v1/jobs", {"offset": 2**63}, "offset"),
    ("/v1/jobs", {"devices": 2**63}, "devices"),
    ("/v1/jobs", {"delta": -(2**63) - 1}, "delta"),
    ("/v1/jobs", {"limit": 10**30}, "limit"),
    ("/v1/jobs", {"model": "a\x00b"}, "model"),
    ("/v1/jobs", {"owner": "x\ny"}, "owner"),
    ("/v1/scores", {"devices": 2**40}, "devices"),
    ("/v1/scores", {"revision": "main\x00"}, "revision"),
    ("/v1/jobs/0123456789abcdef0123456789abcdef/metrics", {"seed": 2**63}, "seed"),
    ("/v1/jobs/0123456789abcdef0123456789abcdef/metrics", {"layout": "\x00"}, "layout"),
    ("/v1/jobs", {"owner": "team\u202eb"}, "owner"),
    ("/v1/jobs", {"model": "tiny\u200b"}, "model"),
    ("/v1/scores", {"model": "a\u2028b"}, "model"),
    ("/v1/scores", {"revision": "main\x85"}, "revision"),
])
def test_overflowing_and_control_query_parameters_are_422(base, path, params, field):
    with app_with(base) as client:
        r = client.get(path, params=params)
        assert r.status_code == 422, r.text
        assert field in fields(r)


@pytest.mark.parametrize(("overrides", "field"), [
    ({"calibration": {"seed": 2**63}}, "calibration.seed"),
    ({"calibration": {"sequences": 2**64}}, "calibration.sequences"),
    ({"calibration": {"text_field": "te\x00xt"}}, "calibration.text_field"),
    ({"calibration": {"source": "corpus:kjv\n"}}, "calibration.source"),
    ({"model": {"id": "owner/name\n"}}, "model.id"),
    ({"model": {"id": "tiny\x00"}}, "model.id"),
    ({"model": {"id": "owner/name", "revision": "main\n"}}, "model.revision"),
    ({"devices": 2**63}, "devices"),
    ({"delta": 2**31}, "delta"),
    ({"distill": {"seeds": [2**63]}}, "distill.seeds.0"),
    ({"distill": {"layouts": ["optimised\x00"]}}, "distill.layouts.0"),
    ({"distill": {"train": {"source": "corpus:kjv", "text_field": "\x00"}}}, "distill.train.text_field"),
])
def test_overflowing_and_control_spec_fields_are_422(base, overrides, field):
    with app_with(base) as client:
        r = client.post("/v1/jobs", json=spec(**overrides))
        assert r.status_code == 422, r.text
        assert field in fields(r), fields(r)


# One rule for every string of a spec (app/core/safe_text.py): the characters an attacker uses to make two
# names look alike or to break a log line, each refused in each kind of spec string, naming it.
SNEAKY = {"\u202e": "RIGHT-TO-LEFT OVERRIDE", "\u2066": "LEFT-TO-RIGHT ISOLATE", "\u200f": "RIGHT-TO-LEFT MARK",
          "\u061c": "ARABIC LETTER MARK", "\u200b": "ZERO WIDTH SPACE", "\u200d": "ZERO WIDTH JOINER",
          "\u2060": "WORD JOINER", "\ufeff": "ZERO WIDTH NO-BREAK SPACE", "\x85": "U+0085", "\x9b": "U+009B",
          "\u2028": "LINE SEPARATOR", "\u2029": "PARAGRAPH SEPARATOR", "\x0b": "U+000B", "\x1e": "U+001E",
          "\u00a0": "NO-BREAK SPACE", "\U000e0041": "TAG LATIN CAPITAL LETTER A"}
SPEC_STRINGS = {
    "model.id": lambda v: {"model": {"id": f"ti{v}ny"}},
    "model.revision": lambda v: {"model": {"id": "owner/name", "revision": f"ma{v}in"}},
    "model.gguf_file": lambda v: {"model": {"id": "tiny", "gguf_file": f"m{v}.gguf"}},
    "calibration.source": lambda v: {"calibration": {"source": f"corpus:{v}kjv"}},
    "calibration.text_field": lambda v: {"calibration": {"text_field": f"te{v}xt"}},
    "distill.layouts.0": lambda v: {"distill": {"layouts": [f"optimised{v}"]}},
    "distill.train.source": lambda v: {"distill": {"train": {"source": f"{v}corpus:kjv"}}},
    "distill.eval.text_field": lambda v: {"distill": {"eval": {"source": "corpus:kjv", "text_field": f"t{v}"}}},
}


def test_bidi_zero_width_c1_and_separators_are_refused_in_every_spec_string(base):
    with app_with(base, rate_limit_per_min=0) as client:  # 128 requests: more than a burst
        for field, make in SPEC_STRINGS.items():
            for char, name in SNEAKY.items():
                r = client.post("/v1/jobs", json=spec(**make(char)))
                assert r.status_code == 422, (field, hex(ord(char)), r.text)
                problems = fields(r)
                assert field in problems and f"U+{ord(char):04X}" in problems[field] and name in problems[field], (
                    field, problems)


def test_spec_strings_and_filters_are_nfc_normalised(base):
    """A string spelt with a combining accent (NFD) is stored, and compared, as its composed form (NFC):
    the spec the job records, and the list filters, whichever spelling each side used. (Model and data
    names are ASCII path parts today; the rule holds for every string field, present and future.)"""
    nfc, nfd = "t\u00e9xt", "te\u0301xt"
    with app_with(base, max_active_jobs=1000) as client:
        r = client.post("/v1/jobs", json=spec(calibration={"text_field": nfd}))
        assert r.status_code == 202, r.text
        assert r.json()["spec"]["calibration"]["text_field"] == nfc
        lists = [client.get("/v1/jobs", params={"model": f"tiny-{spelling}"}) for spelling in (nfc, nfd)]
        assert [x.status_code for x in lists] == [200, 200]
        assert lists[0].json() == lists[1].json()


@pytest.mark.serial  # a latency bound (median < 1 s)
def test_the_key_and_the_rate_limit_come_before_the_body(base, tmp_path):
    """A malformed or deeply nested body from a caller without a valid key is 401, over the rate limit
    429: the body is never parsed. On a real server, a request announcing a body it never sends is
    answered 401 at once, and its connection closed (the server does not wait for the body)."""
    root, kwargs, _ = base
    bodies = {"malformed": b'{"model": ', "nested": b"[" * 60_000, "not utf-8": b"\xff\xfe"}
    with TestClient(create_app(make_settings(root, **kwargs))) as anonymous:
        for what, body in bodies.items():
            for headers in ({}, {"X-API-Key": "dtpk_wrong"}):
                r = anonymous.post("/v1/jobs", content=body, headers={"Content-Type": "application/json", **headers})
                assert r.status_code == 401 and r.json()["field"] == "X-API-Key", (what, headers, r.text)
                assert r.headers["connection"] == "close"
    with app_with(base, rate_limit_per_min=60, rate_limit_burst=2) as client:
        key = {"X-API-Key": create_key(client.app.state.db, name=f"rl-{uuid.uuid4().hex[:8]}")}
        assert [client.get("/v1/jobs", headers=key).status_code for _ in range(2)] == [200, 200]
        for body in bodies.values():
            r = client.post("/v1/jobs", content=body, headers={"Content-Type": "application/json", **key})
            assert r.status_code == 429 and r.json()["error"] == "rate_limited", r.text
    proc, port = _serve(base, tmp_path)
    try:
        for headers in ("", "X-API-Key: dtpk_wrong\r\n"):
            times = []
            for _ in range(5):
                with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                    t0 = time.perf_counter()
                    sock.sendall(f"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{headers}"
                                 "Content-Length: 1000\r\n\r\n".encode())
                    answer = b""
                    while chunk := sock.recv(65536):  # until the server closes the connection
                        answer += chunk
                    times.append(time.perf_counter() - t0)
                assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
            print(f"no body sent, key {headers.strip() or 'missing'}: 401 and closed in "
                  f"{statistics.median(times) * 1e3:.1f} ms (median of 5)")
            assert statistics.median(times) < 1.0
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_control_characters_in_paths_are_404_json(base):
    with app_with(base) as client:
        job = client.post("/v1/jobs", json=spec()).json()["id"]
        for path in ("/v1/jobs/%00", "/v1/jobs/%00/layouts", f"/v1/jobs/{job}/layouts/a%00b",
                     f"/v1/jobs/{job}/artifacts/x%00y", f"/v1/jobs/{job}/artifacts/" + "a" * 255):
            r = client.get(path)
            assert r.status_code == 404 and r.json()["field"] in ("job_id", "name"), (path, r.text)
        assert client.post("/v1/jobs/%00/cancel").status_code == 404
        assert client.get(f"/v1/jobs/{job}/artifacts/" + "a" * 300).status_code == 422


def test_deeply_nested_and_malformed_bodies_are_422(base):
    with app_with(base) as client:
        for body in (b"[" * 60_000, b'{"model": ', b"\xff\xfe", b'{"devices": 1e999999}'):
            r = client.post("/v1/jobs", content=body, headers={"Content-Type": "application/json"})
            assert r.status_code == 422, (body[:20], r.text)
            assert r.json()["detail"][0]["field"], r.text
        infinite = b'{"model": {"id": "tiny"}, "devices": 2, "calibration": {"source": "corpus:kjv"}, ' \
                   b'"distill": {"recipe": {"lr": 1e400}}}'
        r = client.post("/v1/jobs", content=infinite, headers={"Content-Type": "application/json"})
        assert r.status_code == 422 and "distill.recipe.lr" in fields(r), r.text


def test_job_errors_show_no_server_paths(base):
    root, kwargs, _ = base
    settings = make_settings(root, **kwargs)
    with app_with(base) as client:
        job_id = client.post("/v1/jobs", json=spec()).json()["id"]
        with database(settings.database_url).transaction() as session:
            job = session.get(Job, job_id)
            job.status, job.finished_at = "failed", utcnow()
            job.error = (f"model 'tiny': cannot read {settings.models_dir}/tiny/config.json; while reading "
                         f"{settings.storage}/jobs/{job_id}/work/blocks.npy from /usr/lib/python3.11/site.py")
        error = client.get(f"/v1/jobs/{job_id}").json()["error"]
        assert str(root) not in error and "/usr/lib" not in error, error
        assert "MODEL_ROOT/tiny/config.json" in error and f"STORAGE_ROOT/jobs/{job_id}/work/blocks.npy" in error
        assert "…/site.py" in error

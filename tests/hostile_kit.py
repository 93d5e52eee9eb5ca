"""Hostile uploads, built in code (issue 26): GGUF headers with crafted counts, safetensors files with
crafted headers, JSON nested past any parser's stack, a tokenizer.json whose regex panics; and the API
under uvicorn (its own process, memory read from the kernel) with a key per tenant, to send them to.
Used by tests/app/api/test_hostile_uploads.py and bench/hostile_uploads.py."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import httpx

from app.core.db import database
from app.core.keys import create_key
from app.core.migrate import upgrade
from tests.service_kit import free_port, make_settings, provision

PART = 5 << 20


def peak_rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


# ---- hostile files ---------------------------------------------------------------------------------------

def gguf_string(text: bytes) -> bytes:
    return struct.pack("<Q", len(text)) + text


def gguf(entries: list[bytes], tensors: int = 0) -> bytes:
    """A GGUF v3 file's start: the header counts, then the raw metadata entries given."""
    return b"GGUF" + struct.pack("<IQQ", 3, tensors, len(entries)) + b"".join(entries)


def gguf_entry(key: str, kind: int, value: bytes) -> bytes:
    return gguf_string(key.encode()) + struct.pack("<I", kind) + value


def gguf_array(key: str, element_kind: int, count: int, data: bytes = b"") -> bytes:
    return gguf_entry(key, 9, struct.pack("<IQ", element_kind, count) + data)


def safetensors(header: bytes, data: bytes = b"") -> bytes:
    return struct.pack("<Q", len(header)) + header + data


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


TINY_CONFIG = {"model_type": "llama", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "intermediate_size": 64, "vocab_size": 64}
WEIGHTS = safetensors(json.dumps({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode(), b"\0" * 4)


def model(config: bytes | None = None, **files: bytes) -> dict[str, bytes]:
    """A model upload: config.json (the tiny one unless given), one weights file, and `files`."""
    return {"config.json": json.dumps(TINY_CONFIG).encode() if config is None else config,
            "model.safetensors": WEIGHTS, **{k.replace("__", "."): v for k, v in files.items()}}


def panicking_tokenizer(pattern: str) -> bytes:
    """A byte-level tokenizer.json whose pre-tokenizer first splits on `pattern`: the `tokenizers`
    library's regex engine gives up on a runaway match with a panic (PanicException, a BaseException)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={s: i for i, s in enumerate(alphabet)} | {"</s>": len(alphabet)},
                                     merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                                                       pre_tokenizers.ByteLevel(add_prefix_space=False)])
    return tokenizer.to_str().encode()


# ---- the service ------------------------------------------------------------------------------------------

class Service:
    """The API under uvicorn (its own process and memory), and a client per tenant."""

    def __init__(self, root: Path, settings_kwargs: dict,
                 tenants: list[str] | tuple[str, ...] = ("hostile", "other", "third", "fourth")) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.settings = make_settings(root, **settings_kwargs)
        upgrade(self.settings.database_url)
        provision(self.settings)
        db = database(self.settings.database_url)
        self.keys = {name: create_key(db, name=f"{name}-{os.urandom(3).hex()}", tenant=name)
                     for name in tenants}
        self.port = free_port()
        env = {**os.environ, **self.settings.worker_env()}
        self.log = root / "uvicorn.log"
        self.proc = subprocess.Popen([sys.executable, "-m", "uvicorn", "app.api.main:create_app", "--factory",
                                      "--host", "127.0.0.1", "--port", str(self.port), "--log-level", "warning"],
                                     env=env, stdout=self.log.open("wb"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        self.proc.kill()
        raise TimeoutError(self.log.read_text()[-3000:])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, tenant: str) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"X-API-Key": self.keys[tenant]}, timeout=120)

    def peak_rss_mib(self) -> float:
        return peak_rss_kib(self.proc.pid) / 1024

    def send(self, tenant: str, kind: str, files: dict[str, bytes]) -> str:
        """Declare the upload and send every part; its id."""
        with self.client(tenant) as c:
            body = {"kind": kind, "name": "hostile", "files": [
                {"path": p, "size": len(b), "sha256": hashlib.sha256(b).hexdigest()} for p, b in files.items()]}
            r = c.post("/v1/uploads", json=body)
            assert r.status_code == 201, r.text
            upload_id = r.json()["id"]
            for path, data in files.items():
                for n in range(1, max(1, -(-len(data) // PART)) + 1):
                    r = c.put(f"/v1/uploads/{upload_id}/files/{path}/parts/{n}", content=data[(n - 1) * PART:n * PART])
                    assert r.status_code == 204, r.text
        return upload_id

    def complete(self, tenant: str, upload_id: str) -> tuple[httpx.Response, float]:
        with self.client(tenant) as c:
            t0 = time.perf_counter()
            r = c.post(f"/v1/uploads/{upload_id}/complete")
            return r, time.perf_counter() - t0

    def await_completing(self, upload_ids: list[str], within_s: float = 60.0) -> None:
        """Wait until every one of `upload_ids` is being completed at once (the database's `completing_at`
        mark, set after the API took the request's check slot), by `within_s`."""
        from sqlalchemy import func, select

        from app.core.db import Upload

        db = database(self.settings.database_url)
        deadline = time.monotonic() + within_s
        while True:
            with db.session() as session:
                marked = session.scalar(select(func.count()).select_from(Upload).where(
                    Upload.id.in_(upload_ids), Upload.completing_at.is_not(None)))
            if marked == len(upload_ids):
                return
            assert time.monotonic() < deadline, f"{marked} of {len(upload_ids)} completions started in {within_s:g} s"
            time.sleep(0.02)

    def status(self, tenant: str, upload_id: str) -> int:
        with self.client(tenant) as c:
            return c.get(f"/v1/uploads/{upload_id}").status_code

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()

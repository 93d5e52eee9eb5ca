"""`dtp-layout worker` on a GPU: it picks the GPU and the job says so; a job that runs out of GPU memory
ends `failed` with the sizes, and the same worker goes on to the next job.

The stack is the embedded default (SQLite database, SQLite-backed Celery broker, files under a
temporary VAR_DIR): a GPU machine needs no Postgres or Redis for these. The out-of-memory job is made
real, not simulated: the worker's share of the GPU is capped (DTP_LAYOUT_CUDA_MEMORY_FRACTION) below
one embedding matrix of the model the job names.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

from app.api.main import create_app
from app.core.migrate import upgrade
from tests.service_kit import WorkerProcess, make_settings, provision, spec, wait_for

pytestmark = pytest.mark.gpu

CAP_MIB = 256
# One untied embedding matrix of this model is 96000 × 1024 fp32 = 375 MiB, over the cap by itself.
BIG = dict(vocab_size=96000, hidden_size=1024, intermediate_size=256, num_hidden_layers=1, num_attention_heads=8,
           num_key_value_heads=4, max_position_embeddings=64, tie_word_embeddings=False)
BIG_MODEL = "big"


def mib(prefix: str, text: str) -> float:
    """The size right after `prefix` in `text`, in MiB."""
    found = re.search(prefix + r" ([0-9.]+) (MiB|GiB)", text)
    assert found is not None, (prefix, text)
    return float(found.group(1)) * (1024 if found.group(2) == "GiB" else 1)


def embedded_settings(root: Path, **overrides):
    settings = make_settings(root, **overrides)
    upgrade(settings.database_url)
    provision(settings)
    return settings


def cli_worker(settings, name: str, *args: str) -> WorkerProcess:
    """`dtp-layout worker [args]` (as `python -m app.cli.main`, the same entry point) in a subprocess."""
    worker = WorkerProcess(settings, settings.var_dir / f"{name}.log", name=name)
    worker.cmd = [sys.executable, "-m", "app.cli.main", "worker", "--name", name, *args]
    return worker.start(timeout=120)


@pytest.fixture(scope="module")
def picking(tmp_path_factory, accelerator):
    """A worker left to pick its device: `--gpus 0` on a GPU (one child process seeing device 0)."""
    settings = embedded_settings(tmp_path_factory.mktemp("gpu-pick"),
                                 device="auto" if accelerator.type == "cuda" else "cpu")
    worker = cli_worker(settings, "pick", *(["--gpus", "0"] if accelerator.type == "cuda" else []))
    with TestClient(create_app(settings)) as client:
        yield client, worker
    worker.stop()


def test_worker_picks_the_gpu_and_reports_it_in_the_job(picking, accelerator):
    client, worker = picking
    job = client.post("/v1/jobs", json=spec()).json()
    assert job["device"] is None  # no worker has it yet
    done = wait_for(client, job["id"], timeout=180, worker=worker)
    assert done["status"] == "succeeded", done
    device = done["device"]
    assert device["torch"] == torch.__version__
    if accelerator.type == "cuda":
        assert device["device"] == "cuda:0"
        assert device["name"] == torch.cuda.get_device_name(0)
        assert device["memory_total_gib"] > 1 and device["cuda"] == torch.version.cuda
        assert device["visible_devices"] == 1  # --gpus 0: the child sees exactly one device
    else:
        assert device == {**device, "device": "cpu", "name": "cpu"}


@pytest.fixture(scope="module")
def capped(tmp_path_factory, accelerator):
    if accelerator.type != "cuda":
        pytest.skip("a real out-of-memory needs a CUDA allocator to cap (tests/worker/test_device.py injects one "
                    "on the CPU)")
    from transformers import AutoConfig, AutoModelForCausalLM

    total = torch.cuda.get_device_properties(0).total_memory
    settings = embedded_settings(tmp_path_factory.mktemp("gpu-oom"), device="cuda",
                                 cuda_memory_fraction=CAP_MIB * 2**20 / total)
    config = AutoConfig.for_model("llama", **BIG)
    AutoModelForCausalLM.from_config(config).save_pretrained(settings.models_dir / BIG_MODEL)
    worker = cli_worker(settings, "capped")
    with TestClient(create_app(settings)) as client:
        yield client, worker
    worker.stop()


def test_out_of_gpu_memory_fails_the_job_with_the_sizes_and_the_worker_goes_on(capped):
    client, worker = capped
    body = spec(model={"id": BIG_MODEL}, calibration={"seq_len": 16}, random_layouts=0, ablations=False)
    job = client.post("/v1/jobs", json=body).json()
    failed = wait_for(client, job["id"], timeout=180, worker=worker)
    assert failed["status"] == "failed" and failed["error_stage"] == "loading", failed
    error = failed["error"]
    assert error.startswith("out of GPU memory in stage loading on cuda:0"), error
    assert mib(r"needed at least", error) > CAP_MIB and "it tried to allocate" in error
    assert mib(r"may use only", error) == pytest.approx(CAP_MIB, abs=1), error  # the cap, not the whole GPU
    assert failed["device"]["memory_fraction"] == pytest.approx(CAP_MIB * 2**20 / (
        torch.cuda.get_device_properties(0).total_memory))

    # The worker is not wedged: the next job runs on it, under the same cap, and succeeds.
    after = client.post("/v1/jobs", json=spec()).json()
    done = wait_for(client, after["id"], timeout=180, worker=worker)
    assert done["status"] == "succeeded", done
    assert done["device"]["device"] == "cuda:0"

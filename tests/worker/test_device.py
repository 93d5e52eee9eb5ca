"""The worker's device handling on the CPU: what a job records about its device, and an out-of-memory
failure (injected: this machine has no GPU to exhaust) ending the job `failed` with the sizes, after
which the same process runs the next job. tests/gpu/test_gpu_worker.py does it for real on a GPU."""

from __future__ import annotations

import pytest
import torch

from app.core.caller import OPEN
from app.core.db import Job, JobEvent
from app.core.events import device as job_device
from app.core.events import job_events
from app.core.schemas.jobs import JobSpec
from app.core.services.jobs import job_view, submit_job
from models.io.loading import ModelLoadError
from tests.service_kit import spec
from worker import device as D
from worker.entry import run_job

# PyTorch's allocator messages, in the wording of recent releases (2.4+): a plain one and one under a
# per-process memory cap (set_per_process_memory_fraction).
CUDA_OOM = ("CUDA out of memory. Tried to allocate 2.50 GiB. GPU 0 has a total capacity of 139.81 GiB of which "
            "1.06 GiB is free. Including non-PyTorch memory, this process has 138.74 GiB memory in use. Of the "
            "allocated memory 136.20 GiB is allocated by PyTorch, and 1.93 GiB is reserved by PyTorch but "
            "unallocated. If reserved but unallocated memory is large try setting "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.")
CUDA_OOM_CAPPED = ("CUDA out of memory. Tried to allocate 375.00 MiB. GPU 0 has a total capacity of 139.81 GiB of "
                   "which 139.20 GiB is free. Including non-PyTorch memory, this process has 530.00 MiB memory in "
                   "use. 256.00 MiB allowed; Of the allocated memory 12.50 MiB is allocated by PyTorch, and "
                   "7.50 MiB is reserved by PyTorch but unallocated.")
CPU_OOM = "[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: not enough memory: you tried to allocate " \
          "68719476736 bytes."


def test_parse_cuda_oom_reads_every_size():
    assert D.parse_cuda_oom(CUDA_OOM) == {"tried": int(2.5 * D.GIB), "total": int(139.81 * D.GIB),
                                          "free": int(1.06 * D.GIB), "allocated": int(136.2 * D.GIB)}
    capped = D.parse_cuda_oom(CUDA_OOM_CAPPED)
    assert capped["allowed"] == 256 * D.MIB and capped["tried"] == 375 * D.MIB
    assert capped["allocated"] == int(12.5 * D.MIB)
    # The older wording (torch ≤ 2.3) still gives the essentials.
    old = D.parse_cuda_oom("CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 7.93 GiB total capacity; "
                           "130.35 MiB already allocated; 47.06 MiB free; 188.00 MiB reserved in total by PyTorch)")
    assert old == {"tried": 20 * D.MIB, "total": int(7.93 * D.GIB), "free": int(47.06 * D.MIB),
                   "allocated": int(130.35 * D.MIB)}


def test_cuda_oom_message_says_what_was_needed_and_what_there_was():
    message = D.out_of_memory_message(torch.OutOfMemoryError(CUDA_OOM), stage="affinity")
    assert message is not None
    # Without a GPU here the held bytes come from the allocator's own message: 136.20 + 2.50 GiB.
    assert message.startswith("out of GPU memory in stage affinity: needed at least 138.70 GiB "
                              "(136.20 GiB held by the job + 2.50 GiB it tried to allocate) but the GPU has "
                              "139.81 GiB, 1.06 GiB of it free;")
    assert message.endswith("; lower the job's batch_size (calibration sequences per micro-batch), use model.dtype "
                            "bfloat16 or run it on a worker with more memory")
    capped = D.out_of_memory_message(torch.OutOfMemoryError(CUDA_OOM_CAPPED), stage="loading")
    assert capped is not None and "needed at least 387.50 MiB" in capped and "the weights alone do not fit" in capped
    assert "but this worker may use only 256.00 MiB (its memory cap, DTP_LAYOUT_CUDA_MEMORY_FRACTION)" in capped


def test_host_oom_and_other_errors():
    host = D.out_of_memory_message(RuntimeError(CPU_OOM), stage="distilling")
    assert host is not None and host.startswith("out of host memory in stage distilling: the job needed 64.00 GiB "
                                                "in one allocation;")
    assert D.out_of_memory_message(MemoryError(), stage=None) is not None
    assert D.out_of_memory_message(RuntimeError("mat1 and mat2 shapes cannot be multiplied"), stage="affinity") is None
    assert D.out_of_memory_message(ValueError("out of memory"), stage="affinity") is None


def test_prepare_device_on_a_machine_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for setting in ("auto", "cpu"):
        info = D.prepare_device(setting, memory_fraction=0.5)  # the cap only concerns GPUs
        assert info == {"device": "cpu", "name": "cpu", "torch": torch.__version__,
                        "threads": torch.get_num_threads()}
    with pytest.raises(ModelLoadError, match="CUDA is not available"):
        D.prepare_device("cuda")
    with pytest.raises(ModelLoadError, match="device must be"):
        D.prepare_device("tpu")


def test_job_device_is_the_latest_attempts():
    history = [JobEvent(kind="submitted"), JobEvent(kind="stage-start", stage="loading", device={"device": "cuda:1"}),
               JobEvent(kind="requeued"), JobEvent(kind="stage-start", stage="loading", device={"device": "cuda:0"}),
               JobEvent(kind="stage-done", stage="loading")]
    assert job_device(history) == {"device": "cuda:0"}
    assert job_device([JobEvent(kind="submitted")]) is None and job_device([]) is None


def submit(settings, db, **overrides) -> str:
    body = JobSpec.model_validate(spec(random_layouts=0, ablations=False, export=False, **overrides))
    with db.session() as session:
        return submit_job(session=session, settings=settings, spec=body, caller=OPEN, enqueue=lambda _job_id: None).id


def test_out_of_memory_fails_the_job_with_the_sizes_then_the_next_job_runs(embedded, monkeypatch):
    from models.run import pipeline
    settings, db = embedded
    real_stage = pipeline.stage_affinity

    def exhausted(*_args, **_kwargs):
        raise torch.OutOfMemoryError(CUDA_OOM)

    monkeypatch.setattr(pipeline, "stage_affinity", exhausted)
    first = submit(settings, db)
    assert run_job(first, settings=settings, db=db, worker="test:1") == "failed"
    with db.session() as session:
        job = session.get(Job, first)
        view = job_view(job, history=job_events(session, first))
    assert view["status"] == "failed" and view["error_stage"] == "affinity" and view["stage"] == "affinity"
    assert view["error"].startswith("out of GPU memory in stage affinity: needed at least 138.70 GiB")
    assert view["device"]["device"] == "cpu"
    assert view["stages_done"] == ["loading", "calibration"]

    # The same process (a worker is one) takes the next job and finishes it.
    monkeypatch.setattr(pipeline, "stage_affinity", real_stage)
    second = submit(settings, db, calibration={"seed": 1})
    assert run_job(second, settings=settings, db=db, worker="test:1") == "succeeded"
    with db.session() as session:
        view = job_view(session.get(Job, second), history=job_events(session, second))
    assert view["status"] == "succeeded" and view["device"] == {
        "device": "cpu", "name": "cpu", "torch": torch.__version__, "threads": torch.get_num_threads()}

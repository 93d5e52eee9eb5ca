"""Sharded distillation (FSDP2 over gloo, on CPU): the gradients, the curve, kill and resume, resharding.

W = 2 must follow W = 1 (student and frozen teacher both sharded): the same teacher logits from about
half its weights per rank, the same gradients from one micro-batch (the simulator's weights read through
FSDP's registered methods), the same losses over 20 steps, the same curve after a SIGKILL and a resume,
at the same or another world size (the DCP checkpoint is resharded).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor

from models import distill as D
from models.distill.loss import loss_and_backward, teacher_hidden
from models.distill.sharding import Ranks, free_port, local_bytes, shard_student, shard_teacher
from models.distill.student import lm_head
from models.sim.dtp import gathered
from tests.models.distill import sharded_kit as kit
from tests.models.distill.kit import VOCAB, layout_of

REPO = str(Path(__file__).resolve().parents[3])
TOL = 1e-5


def _grads(world_size: int, rank: int = 0) -> dict[str, torch.Tensor]:
    """Gradients of one global batch [4, S], this process being `rank` of `world_size` (a group exists);
    with W > 1 the teacher is sharded too, and "teacher/..." entries say what it holds and computes."""
    teacher, train, _ = kit.setup()
    student = D.make_student(teacher, layout_of(teacher), kit.recipe())
    ranks = Ranks(rank, world_size)
    whole_bytes = local_bytes(teacher)
    if ranks.sharded:
        shard_student(student, torch.device("cpu"))
        teacher = shard_teacher(copy.deepcopy(teacher), torch.device("cpu"))
    batch = train[:4]  # [B, S]
    b, s = batch.shape
    w = ranks.world_size  # each rank's share of the tokens: FSDP2 averages the ranks' gradients
    loss_and_backward(student, teacher, ranks.local_rows(batch), recipe=kit.recipe(), kl_norm=b * s // w,
                      ce_norm=b * (s - 1) // w)
    with torch.no_grad():  # after a training step: the teacher's output, through its gathered method
        hidden = gathered(teacher, teacher_hidden, teacher, train[:4])  # [4, S, D]
        logits = gathered(teacher, lambda h: lm_head(teacher)(h), hidden)  # [4, S, V]
    teacher_stats = {"teacher/logits": logits, "teacher/whole_bytes": torch.tensor(whole_bytes),
                     "teacher/local_bytes": torch.tensor(local_bytes(teacher)),
                     "teacher/frozen": torch.tensor(not any(p.requires_grad for p in teacher.parameters())),
                     # FSDP2 registers the sharded parameters as DTensors, gathered ones as plain tensors
                     "teacher/resharded": torch.tensor(all(isinstance(p, DTensor) for p in teacher.parameters()))}
    out = {}
    for name, p in D.trainable_parameters(student):
        g = p.grad
        out[name] = g.full_tensor() if hasattr(g, "full_tensor") else g  # DTensor shards gathered
    return {**out, **teacher_stats}


def _grads_rank(rank: int, world_size: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        grads = _grads(world_size, rank)
        if rank == 0:
            torch.save(grads, out)
    finally:
        dist.destroy_process_group()


def test_gradients_at_w1_and_w2_are_equal(tmp_path):
    out = tmp_path / "grads.pt"
    mp.spawn(_grads_rank, args=(2, free_port(), str(out)), nprocs=2, join=True)
    sharded = torch.load(out, weights_only=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        whole = _grads(1)
    finally:
        torch.set_num_threads(threads)
    assert sharded.keys() == whole.keys()
    # the sharded teacher computes the same logits, holds about 1/W of its weights, frozen and resharded
    torch.testing.assert_close(sharded.pop("teacher/logits"), whole.pop("teacher/logits"), rtol=1e-6, atol=1e-6)
    local, total = int(sharded.pop("teacher/local_bytes")), int(sharded.pop("teacher/whole_bytes"))
    assert total == int(whole.pop("teacher/whole_bytes")) == int(whole.pop("teacher/local_bytes"))
    assert total / 2 <= local <= total / 2 * 1.05, (local, total)  # dim-0 shards, rounded up per tensor
    assert bool(sharded.pop("teacher/frozen")) and bool(sharded.pop("teacher/resharded"))
    whole.pop("teacher/frozen"), whole.pop("teacher/resharded")
    assert any("lm_head" in k for k in whole) and any("layers.2.mlp.down_proj" in k for k in whole)
    for name, g in whole.items():
        assert g.abs().max() > 0, name  # every trainable tensor gets a gradient
        torch.testing.assert_close(sharded[name], g, rtol=1e-5, atol=1e-7, msg=name)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The uninterrupted W = 1 run: the curve everything else must follow."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return kit.run(tmp_path_factory.mktemp("w1") / "run", 1)
    finally:
        torch.set_num_threads(threads)


def _same_curve(a: D.RunResult, b: D.RunResult, from_step: int = 0) -> None:
    steps_a = [s for s in a.steps if s.step >= from_step]
    steps_b = [s for s in b.steps if s.step >= from_step]
    assert [s.step for s in steps_a] == [s.step for s in steps_b] and steps_a
    for x, y in zip(steps_a, steps_b, strict=True):
        assert y.loss == pytest.approx(x.loss, abs=TOL), x.step
        assert y.grad_norm == pytest.approx(x.grad_norm, rel=TOL), x.step
        assert y.lr == x.lr
    assert [r.step for r in a.records] == [r.step for r in b.records] == [0, 5, 10, 15, 20]
    for x, y in zip(a.records, b.records, strict=True):
        assert y.kl == pytest.approx(x.kl, abs=TOL) and y.ppl == pytest.approx(x.ppl, rel=TOL)


def test_w2_matches_w1_over_20_steps(single, tmp_path):
    sharded = kit.run(tmp_path / "run", 2)
    _same_curve(single, sharded)
    assert single.records[-1].kl < single.records[0].kl  # it learns


def _killed(run_dir: Path, world_size: int, kill_after: int) -> None:
    code = f"from tests.models.distill.sharded_kit import main; main({str(run_dir)!r}, {world_size}, {kill_after})"
    child = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                           env={**os.environ, "PYTHONPATH": REPO})
    assert child.returncode == -signal.SIGKILL, child.stderr[-3000:]


# Resuming at another world size (1) always runs; at the same one (2) and at W = 4 (four gloo ranks on a
# 2-core machine, the slowest variant) only with DTP_LAYOUT_TEST_LONG=1 (tests/conftest.py, `long`).
@pytest.mark.parametrize("resume_at", [1, pytest.param(2, marks=pytest.mark.long),
                                       pytest.param(4, marks=pytest.mark.long)])
def test_kill_at_step_10_then_resume_gives_the_same_curve(single, tmp_path_factory, resume_at):
    """Killed (SIGKILL, ranks and all) after step 11 of a W = 2 run: resumed from the step-10
    checkpoint at W = 1 (or 2 and 4: DTP_LAYOUT_TEST_LONG=1), the curve is the uninterrupted one."""
    killed = tmp_path_factory.getbasetemp() / "killed-w2"
    if not killed.exists():
        _killed(killed, 2, kill_after=11)
    run_dir = tmp_path_factory.mktemp(f"resume-w{resume_at}") / "run"
    shutil.copytree(killed, run_dir)
    state = (run_dir / "checkpoint" / "run_state.json").read_text()
    assert '"step": 10' in state and '"world_size": 2' in state
    resumed = kit.run(run_dir, resume_at)
    assert resumed.resumed_from == 10
    _same_curve(single, resumed, from_step=10)


def test_under_torchrun_only_rank_0_writes_the_outputs(tmp_path):
    """Two processes started as torchrun starts them (RANK, WORLD_SIZE, MASTER_ADDR/PORT), each with its
    own out_dir to tell their writes apart: rank 1 trains the same run but writes no summary, metrics,
    figure or run logs, and calls no progress or callback."""
    np.save(tmp_path / "ids.npy", np.random.default_rng(0).integers(0, VOCAB, size=40 * 16))
    port = free_port()
    procs = []
    for rank in (0, 1):
        code = ("from tests.models.distill.sharded_kit import compare_main; "
                f"compare_main({str(tmp_path / 'ids.npy')!r}, {str(tmp_path / f'out{rank}')!r}, "
                f"{str(tmp_path / f'calls{rank}.json')!r})")
        env = {**os.environ, "PYTHONPATH": REPO, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outputs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs[0][1][-3000:] + outputs[1][1][-3000:]
    calls = [json.loads((tmp_path / f"calls{rank}.json").read_text()) for rank in (0, 1)]
    assert calls[0]["kl"] == calls[1]["kl"]  # the same run, agreed by both ranks
    assert calls[0]["on_step"] == 4 and calls[0]["on_eval"] == 3 and calls[0]["on_run_start"] == 1
    assert calls[0]["progress"] > 0
    assert {k: v for k, v in calls[1].items() if k != "kl"} == {"progress": 0, "on_eval": 0, "on_step": 0,
                                                                "on_run_start": 0}
    out0, out1 = tmp_path / "out0", tmp_path / "out1"
    for name in ("summary.json", "metrics.csv", "curves.png"):
        assert (out0 / name).is_file() and not (out1 / name).exists(), name
    run0, run1 = (D.run_dir_for(out, "contiguous", 0) for out in (out0, out1))
    for name in ("metrics.json", "steps.csv"):
        assert (run0 / name).is_file() and not (run1 / name).exists(), name
    assert json.loads((out0 / "summary.json").read_text())["layouts"]["contiguous"]["kl"] == calls[0]["kl"]

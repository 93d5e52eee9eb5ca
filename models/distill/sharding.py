"""Sharded distillation: W ranks of torch.distributed, the student sharded with FSDP2, data parallel.

Every rank builds the same student, then `shard_student` applies `fully_shard` to each decoder
layer and then to the root, as torchtitan does. The simulator reads weights outside `forward()`
(`models.sim.dtp.gathered`): each layer and the root get a `gathered` method registered with
`register_fsdp_forward_method`, so the parameters are all-gathered around it and the gradients
reduce-scattered after its backward. FSDP2 averages the gradients over the ranks (a custom divide
factor would need PREMUL_SUM, which gloo lacks), so each rank normalises its loss by its own share of
the global batch's tokens (B·S / W, B divisible by W): the mean over ranks is the W = 1 gradient.

Each rank takes rows [r·B/W, (r+1)·B/W) of the global batch (same batch, same order as W = 1); every
rank evaluates every held-out block (the FSDP collectives need every rank in every forward), so the
evaluation is the W = 1 one. The frozen teacher is sharded too (`shard_teacher`: each decoder layer
and the root, resharded after every forward, so a rank holds 1/W of it between uses); every use of
it goes through its own `gathered` method under `torch.no_grad()` (its embeddings, final norm and LM
head whole inside, each layer gathered by its own forward). Rank 0 writes the logs and owns the
hooks; the stop request is agreed by all ranks at each step.

`Ranks.single()` is W = 1 in one process with no process group: every collective is the identity.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from models.sim.dtp import GATHERED, DTPModel, call_through

BACKEND_TIMEOUT = timedelta(minutes=10)  # a rank that died leaves the others waiting at most this long


@dataclass(frozen=True)
class Ranks:
    """This process's place among the W ranks of a distillation."""

    rank: int = 0
    world_size: int = 1

    @classmethod
    def single(cls) -> Ranks:
        return cls()

    @classmethod
    def current(cls) -> Ranks:
        """The initialised default process group's rank and size (W = 1 when there is none)."""
        if not dist.is_available() or not dist.is_initialized():
            return cls()
        return cls(dist.get_rank(), dist.get_world_size())

    @property
    def sharded(self) -> bool:
        return self.world_size > 1

    @property
    def writer(self) -> bool:
        """Whether this rank writes the run's logs and the checkpoint's metadata (rank 0)."""
        return self.rank == 0

    def local_rows(self, batch: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the global batch [B, S]: [B/W, S], in order."""
        share = batch.shape[0] // self.world_size
        return batch[self.rank * share : (self.rank + 1) * share]

    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sums over the ranks (float64)."""
        if not self.sharded:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=_collective_device())
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return [float(v) for v in t.cpu()]

    def any(self, flag: bool) -> bool:
        """Whether any rank says yes (every rank gets the same answer)."""
        if not self.sharded:
            return flag
        return self.sum([1.0 if flag else 0.0])[0] > 0

    def barrier(self) -> None:
        if self.sharded:
            dist.barrier()


def _collective_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def backend_for(device: torch.device) -> str:
    """NCCL on GPUs, gloo on CPU."""
    return "nccl" if device.type == "cuda" else "gloo"


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r's device: cuda:r (of the GPUs this process sees) on GPUs, the CPU otherwise."""
    return torch.device("cuda", rank) if device.type == "cuda" else torch.device("cpu")


def shard_student(student: DTPModel, device: torch.device) -> DTPModel:
    """FSDP2 over the default process group: `fully_shard` on every decoder layer, then on the root;
    each gets its `GATHERED` method registered (gradients are averaged over the ranks)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    # The partials are views ([P, B·S, D] -> [P, B, S, D]); the recurrence only adds them out of place
    # (x = x + o), which keeps FSDP's pre-backward hook, so its warning about in-place ops does not apply.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in student.layers:
        setattr(layer, GATHERED, call_through.__get__(layer))  # a method of this layer alone
        fully_shard(layer, mesh=mesh)
        register_fsdp_forward_method(layer, GATHERED)
    fully_shard(student, mesh=mesh)
    register_fsdp_forward_method(student, GATHERED)
    return student


def shard_teacher(teacher: nn.Module, device: torch.device) -> nn.Module:
    """FSDP2 over the frozen teacher (a causal LM, in place): `fully_shard` on every decoder layer, then
    on the root, resharded after every forward (it has no backward to wait for), parameters frozen.
    Use it only through `gathered(teacher, ...)` under `torch.no_grad()`: the root's registered method
    makes its embeddings, final norm and LM head whole; each layer's forward gathers that layer."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    for p in teacher.parameters():
        p.requires_grad_(False)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    inner: Any = teacher
    for layer in inner.model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    setattr(teacher, GATHERED, call_through.__get__(teacher))
    # reshard_after_forward=True given explicitly: FSDP2 keeps an implicit root's parameters whole after
    # its forward (for the backward a teacher never has); given, the root reshards like every layer.
    fully_shard(teacher, mesh=mesh, reshard_after_forward=True)
    register_fsdp_forward_method(teacher, GATHERED)
    return teacher


def local_bytes(module: nn.Module) -> int:
    """Bytes of the parameters this rank holds (its shards, under FSDP2)."""
    total = 0
    for p in module.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total


def total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The global 2-norm of (possibly sharded) gradients, as a plain tensor."""
    from torch.distributed.tensor import DTensor

    norm = torch.nn.utils.get_total_norm(grads, 2.0)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    return norm


def init_from_env(device: torch.device) -> Ranks:
    """Join the process group torchrun (or `launch`) described in RANK/WORLD_SIZE/MASTER_ADDR/PORT."""
    rank = int(os.environ["RANK"])
    dev = rank_device(device, int(os.environ.get("LOCAL_RANK", rank)))
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group(backend_for(device), rank=rank, world_size=int(os.environ["WORLD_SIZE"]),
                            timeout=BACKEND_TIMEOUT)
    return Ranks.current()


def torchrun_world() -> int | None:
    """WORLD_SIZE when this process was started by torchrun (RANK and WORLD_SIZE set), else None."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return None


def launch_rank() -> int:
    """This process's rank when torchrun started it (RANK), else 0: only rank 0 writes a run's outputs."""
    return int(os.environ["RANK"]) if torchrun_world() is not None else 0


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def die_with_parent() -> None:
    """Linux: this process gets SIGKILL when its parent dies (a killed launcher leaves no rank behind)."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def rank_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def run_children(world_size: int, target: Any, payload: dict[str, Any]) -> tuple[list[Any], dict[str, str]]:
    """Start ranks 1 .. W-1 as spawned processes running target(env, payload); the env of rank 0."""
    import torch.multiprocessing as mp

    port = free_port()
    ctx = mp.get_context("spawn")
    children = []
    for rank in range(1, world_size):
        proc = ctx.Process(target=target, args=(rank_env(rank, world_size, port), payload), daemon=False)
        proc.start()
        children.append(proc)
    return children, rank_env(0, world_size, port)

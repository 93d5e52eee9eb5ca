"""The overlapped exchange as torch custom ops that torch.compile keeps opaque and CUDA graphs can capture.

A DTP exchange starts after the module that completes it and is waited modules later, just before the
module it is due at (`models.runtime.arrivals`). Python async work handles (`dist.all_reduce(...,
async_op=True)`) can be neither traced by torch.compile nor captured by a CUDA graph; these ops can:

    handle = start(t, group_name)   # torch.ops.dtp_layout.exchange_start: Σ_ranks t begun, not yet usable
    total = wait(handle)            # torch.ops.dtp_layout.exchange_wait: Σ_ranks t, a new tensor
    wait_into(handle, out)          # torch.ops.dtp_layout.exchange_wait_into: Σ_ranks t written into out

On CUDA, start copies t into the handle on the compute stream and launches the all-reduce of the handle
on a side stream that first waits for the compute stream (an event: the fork); wait makes the compute
stream wait on the side stream's completion event (the join) and copies the sum out on the compute
stream. Both are plain stream operations that a CUDA graph captures (NCCL collectives can be captured);
compute issued between start and wait runs beside the all-reduce. Elsewhere (gloo, CPU tensors) start
begins an asynchronous all-reduce and keeps its work handle, and wait waits on it. Either way the numbers
are those of a plain all-reduce.

For torch.compile the ops are opaque, and start and wait functional: each returns a new contiguous tensor
shaped like its input (their fake kernels say so; they also serve the meta device) and mutates nothing (the
handle's contents are the ops' own business until a wait reads them, and nothing else may read it);
wait_into declares that it mutates `out` alone, so a compiler that functionalises it copies `out`, never
the handle. Compiled code calls them as they are. A wait on a tensor that no start returned is refused, so a
compiler that copied or merged handles would fail loudly instead of adding a sum that is not there yet.
What torch.compile does not promise is where compute lands relative to the pair: inductor's
`reorder_for_locality` moves producers next to their consumers, which can put the compute meant to overlap
before the start or after the wait (the numbers are the same). vLLM keeps program order by splitting its
graph at these ops (`SPLITTING_OPS`): they run between the compiled pieces, in the order the model wrote.

Every start must be waited, on the device and stream it was started from, before its handle is dropped.
Inside a CUDA graph, start and wait must be captured in the same graph (a fork is joined before capture
ends): vLLM's piecewise CUDA graphs capture the pieces between splitting ops, so with the ops among them
each runs uncaptured between two pieces, and the sum must then go where the next piece reads it at every
replay, a buffer the piece before allocated: wait_into; its full CUDA graphs (`cudagraph_mode` FULL or
FULL_DECODE_ONLY) capture the whole forward, the fork and join inside it, where either wait serves.

The process group is named as torch.distributed names it (`ProcessGroup.group_name`, resolved with
`_resolve_process_group`), a string, so the ops' schema holds no Python object. Only torch is imported:
the plugin (`models.serving.vllm`) and the tests use the ops alike.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import GroupName, _resolve_process_group

__all__ = ["NAMESPACE", "SPLITTING_OPS", "START", "WAIT", "WAIT_INTO", "ExchangeError", "start", "wait", "wait_into"]

NAMESPACE = "dtp_layout"
START = f"{NAMESPACE}::exchange_start"
WAIT = f"{NAMESPACE}::exchange_wait"
WAIT_INTO = f"{NAMESPACE}::exchange_wait_into"
SPLITTING_OPS = (START, WAIT, WAIT_INTO)  # for vLLM's compilation_config.splitting_ops, beside its attention ops


class ExchangeError(RuntimeError):
    """A wait that no start matches, or a group name that names no process group."""


class _Pending(Protocol):
    def wait(self) -> object: ...


class _CudaExchange:
    """An all-reduce launched on a side stream: the event the compute stream waits on to use its result."""

    def __init__(self, done: torch.cuda.Event, device: torch.device) -> None:
        self.done, self.device = done, device

    def wait(self) -> None:
        torch.cuda.current_stream(self.device).wait_event(self.done)  # the join: the host does not block


# (device, data pointer) of a started handle -> what its wait waits on. A handle is alive, so its memory is
# its own, from start to wait; an entry left by a handle dropped unwaited is overwritten by the next start
# that gets the same memory.
_pending: dict[tuple[str, int], _Pending] = {}
_side_streams: dict[int, torch.cuda.Stream] = {}


def _key(t: torch.Tensor) -> tuple[str, int]:
    return str(t.device), t.data_ptr()


def _group(group_name: str) -> dist.ProcessGroup:
    try:
        group: dist.ProcessGroup = _resolve_process_group(GroupName(group_name))
    except (RuntimeError, ValueError) as exc:
        raise ExchangeError(f"no process group is named {group_name!r} (give ProcessGroup.group_name of an "
                            "initialised group)") from exc
    return group


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """One high-priority side stream per GPU, made the first time (outside any capture: the eager warm-up)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _side_streams:
        _side_streams[index] = torch.cuda.Stream(device=index, priority=-1)
    return _side_streams[index]


def _options(*, async_op: bool) -> dist.AllreduceOptions:
    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp(dist.ReduceOp.SUM)
    if hasattr(options, "asyncOp"):  # torch ≥ 2.8; NCCL, when False: the collective runs on the current stream
        options.asyncOp = async_op
    return options


_OPTIONS = {flag: _options(async_op=flag) for flag in (False, True)}  # made once: each call copies them


def _all_reduce(total: torch.Tensor, group: dist.ProcessGroup, *, async_op: bool) -> dist.Work:
    return group.allreduce([total], _OPTIONS[async_op])


def _start_on_side_stream(total: torch.Tensor, group: dist.ProcessGroup) -> _CudaExchange:
    compute = torch.cuda.current_stream(total.device)
    side = _side_stream(total.device)
    if side == compute:
        raise ExchangeError("exchange_start was called from the exchange's own side stream")
    side.wait_stream(compute)  # the fork: the side stream starts once the handle holds t
    with torch.cuda.stream(side):
        _all_reduce(total, group, async_op=False).wait()  # wait(): the side stream (not the host) waits
        done = torch.cuda.Event()
        done.record(side)
    return _CudaExchange(done, total.device)


def _exchange_start(t: torch.Tensor, group_name: str) -> torch.Tensor:
    group = _group(group_name)
    total = t.clone(memory_format=torch.contiguous_format)  # [*t.shape], contiguous whatever t's strides
    if total.is_cuda:
        _pending[_key(total)] = _start_on_side_stream(total, group)
    else:
        _pending[_key(total)] = _all_reduce(total, group, async_op=True)
    return total


def _exchange_start_fake(t: torch.Tensor, group_name: str) -> torch.Tensor:
    return t.new_empty(t.shape)  # contiguous, as the real kernel's


def _join(handle: torch.Tensor) -> None:
    pending = _pending.pop(_key(handle), None)
    if pending is None:
        raise ExchangeError(f"exchange_wait on a tensor no exchange_start returned (or one already waited): "
                            f"shape {tuple(handle.shape)} on {handle.device}")
    pending.wait()


def _exchange_wait(handle: torch.Tensor) -> torch.Tensor:
    _join(handle)
    return handle.clone()  # after the join, on the compute stream: [*handle.shape], contiguous


def _exchange_wait_fake(handle: torch.Tensor) -> torch.Tensor:
    return handle.new_empty(handle.shape)


def _exchange_wait_into(handle: torch.Tensor, out: torch.Tensor) -> None:
    if out.shape != handle.shape:
        raise ExchangeError(f"exchange_wait_into: out is shaped {tuple(out.shape)}, the exchange "
                            f"{tuple(handle.shape)}")
    _join(handle)
    out.copy_(handle)  # after the join, on the compute stream


def _exchange_wait_into_fake(handle: torch.Tensor, out: torch.Tensor) -> None:
    return None


# Registered straight on the dispatcher, one kernel per device type, as vLLM registers its collectives: on
# this CPU torch.library.custom_op's Python wrapper added about 29 µs of the calling thread's CPU time to a
# start/wait pair, this registration about 9 (a [1, 768] fp32 pair in a gloo world of one, the best of 7 ×
# 3000), and a decode step may make two pairs a layer. The ops live as long as this Library object (the module).
_LIBRARY = torch.library.Library(NAMESPACE, "FRAGMENT")


def _register(name: str, kernel: Callable[..., torch.Tensor | None], fake: Callable[..., torch.Tensor | None],
              mutates: tuple[str, ...] = ()) -> None:
    _LIBRARY.define(name + torch.library.infer_schema(kernel, mutates_args=mutates))
    for dispatch_key in ("CPU", "CUDA"):
        _LIBRARY.impl(name, kernel, dispatch_key)
    torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=_LIBRARY)  # FakeTensorMode and the meta device


_register("exchange_start", _exchange_start, _exchange_start_fake)
_register("exchange_wait", _exchange_wait, _exchange_wait_fake)
_register("exchange_wait_into", _exchange_wait_into, _exchange_wait_into_fake, mutates=("out",))


def start(t: torch.Tensor, group_name: str) -> torch.Tensor:
    """Begin Σ over the ranks of `group_name` of t ([*]); returns the handle, a new tensor shaped like t that
    holds the sum only once `wait` has returned it. t itself is not changed and may be reused at once."""
    handle: torch.Tensor = torch.ops.dtp_layout.exchange_start(t, group_name)
    return handle


def wait(handle: torch.Tensor) -> torch.Tensor:
    """Wait for the exchange `start` returned `handle` for; returns the sum, a new tensor shaped like it."""
    total: torch.Tensor = torch.ops.dtp_layout.exchange_wait(handle)
    return total


def wait_into(handle: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """`wait`, the sum written into `out` (shaped like the handle; any strides); returns out. For graphs captured
    in pieces with the ops between them (vLLM's piecewise CUDA graphs): a piece reads its inputs where they
    were at capture, so the sum must land in a buffer the piece before allocated, not in a new tensor."""
    torch.ops.dtp_layout.exchange_wait_into(handle, out)
    return out

"""bench/gpu_check.py's exchange-graph stage: the exchange ops (models/serving/exchange_ops.py) captured in a
CUDA graph on one GPU, replayed, and checked against eager (issue 42: what lets the vLLM plugin drop
--enforce-eager on GPUs).

    exchange-graph  a world of one NCCL rank on the check's GPU; a module of two linear layers with an
                    exchange between (start after the first, the second computed while it is in flight,
                    wait, the others' share added), fp32 with TF32 off, a few token counts, each to 1e-5:
                    eager with the ops         = the same arithmetic through a blocking all-reduce
                    torch.compile(fullgraph)   = eager
                    a CUDA graph of eager      = eager, replayed on new inputs copied into its static input
                    a CUDA graph of compiled   = eager (the way vLLM runs a compiled model under graphs)
                    a CUDA graph of eager with wait_into (the sum into a buffer allocated before) = eager
                    and the time of one call eager, compiled, and replayed. Without CUDA or NCCL: not
                    applicable, with the reason.

One rank sums one term, so the numbers show that the captured fork (the side stream), collective and join
run and return the operand, not that a second rank's share arrives on time; with 2 GPUs the serve-vllm stage
runs the exchange across ranks. The comparisons (`compare_eager_and_compiled`) also run on the CPU in a gloo
world of one: tests/bench/test_gpu_check.py runs them there.
"""

from __future__ import annotations

import copy
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from models.serving import exchange_ops as X

if TYPE_CHECKING:
    from bench.gpu_check import Check

HIDDEN = 1024
TOKENS = (8, 8, 8)  # a CUDA graph replays one shape: the static input's; the values differ per replay
COMPILE_TOKENS = (8, 3, 16)  # torch.compile(dynamic=True) meets several token counts
# fp32, TF32 off. A graph replays eager's own kernels (equal to the bit); inductor may pick another GEMM (bias
# unfused, another split of K = 1024): outputs of about 0.5 then differ by some 1e-7, well inside this
TOL = 1e-5
TIMED_CALLS = 50
CAPTURE_MODE = "global"


class Exchanged(nn.Module):
    """Two linear layers with an exchange between, as a DTP module uses one: the first layer's output is summed
    over the ranks while the second computes, and the others' share (total − own) is added after."""

    def __init__(self, hidden: int, *, into: bool = False) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)
        self.into = into  # the sum through wait_into, into a buffer allocated before the wait (vLLM's pieces)

    def forward(self, x: torch.Tensor, group_name: str) -> torch.Tensor:
        own = self.first(x)  # [T, D]
        handle = X.start(own, group_name)
        y = self.second(x)  # [T, D]: computed while the exchange is in flight
        total = X.wait_into(handle, torch.empty_like(own)) if self.into else X.wait(handle)  # [T, D]
        return y + (total - own)  # the others' share (total − own)


def not_applicable(device: torch.device) -> str | None:
    """Why the stage cannot run on `device`, or None."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return f"no CUDA GPU (device {device}, torch {torch.__version__}): CUDA graphs capture CUDA streams alone"
    if not dist.is_nccl_available():
        return f"this torch ({torch.__version__}) has no NCCL backend: the exchange's all-reduce needs it on a GPU"
    return None


@contextmanager
def world_of_one(device: torch.device) -> Iterator[str]:
    """This process as the one rank of a fresh process group (NCCL on a GPU, gloo on the CPU); its name."""
    if dist.is_initialized():
        raise RuntimeError("a process group is already initialised in this process")
    backend = "nccl" if device.type == "cuda" else "gloo"
    with tempfile.TemporaryDirectory(prefix="dtp-exchange-") as tmp:
        store = dist.FileStore(str(Path(tmp) / "store"), 1)
        extra: dict[str, Any] = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend, store=store, rank=0, world_size=1, **extra)
        try:
            yield dist.distributed_c10d._get_default_group().group_name
        finally:
            dist.destroy_process_group()


def reference(module: Exchanged, x: torch.Tensor) -> torch.Tensor:
    """The module's arithmetic written out, through a blocking all-reduce of the default group: no exchange op."""
    own = x @ module.first.weight.T + module.first.bias
    total = own.clone()
    dist.all_reduce(total)
    return (x @ module.second.weight.T + module.second.bias) + (total - own)


def inputs(module: Exchanged, tokens: tuple[int, ...], device: torch.device, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(t, module.first.in_features, generator=g).to(device) for t in tokens]  # [T, D] each


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def check_close(what: str, diffs: list[float]) -> float:
    worst = max(diffs)
    if not worst <= TOL:
        raise RuntimeError(f"{what} differs from eager by {worst:.3g} (tolerance {TOL:g})")
    return worst


def median_call_us(fn: Callable[[], Any], sync: Callable[[], None], calls: int = TIMED_CALLS) -> float:
    times = []
    for _ in range(calls):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return round(statistics.median(times) * 1e6, 1)


def compare_eager_and_compiled(module: Exchanged, name: str, device: torch.device, rec: dict[str, Any]) -> Any:
    """Eager with the ops against the blocking reference, then torch.compile(fullgraph=True) against eager;
    returns the compiled module."""
    with torch.no_grad():
        xs = inputs(module, COMPILE_TOKENS, device, seed=1)
        rec["eager_vs_reference"] = check_close("eager with the exchange ops",
                                                [max_diff(module(x, name), reference(module, x)) for x in xs])
        compiled = torch.compile(module, fullgraph=True, dynamic=True)
        t0 = time.perf_counter()
        first = compiled(xs[0], name)
        rec["compile_s"] = round(time.perf_counter() - t0, 2)
        diffs = [max_diff(first, module(xs[0], name))] + [max_diff(compiled(x, name), module(x, name))
                                                          for x in xs[1:]]
        rec["compiled_vs_eager"] = check_close("torch.compile(fullgraph=True)", diffs)
    if X._pending:
        raise RuntimeError(f"{len(X._pending)} exchange(s) started and never waited")
    return compiled


def capture(fn: Callable[[torch.Tensor], torch.Tensor], static_x: torch.Tensor,
            device: torch.device) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """fn(static_x) warmed up on a side stream (torch's recipe), then captured; the graph and its static output."""
    warm = torch.cuda.Stream(device)
    warm.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(warm):
        for _ in range(3):
            fn(static_x)
    torch.cuda.current_stream(device).wait_stream(warm)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    # global, torch's default and what vLLM captures with: a capture that vLLM's would break breaks here too
    # (ProcessGroupNCCL enqueues nothing for its watchdog while a stream captures, and its watchdog has queried
    # its events in thread-local mode: pytorch#102542, #148594)
    with torch.cuda.graph(graph, capture_error_mode=CAPTURE_MODE):
        static_out = fn(static_x)
    return graph, static_out


def replay_against_eager(what: str, fn: Callable[[torch.Tensor], torch.Tensor], eager: Callable[[torch.Tensor],
                         torch.Tensor], xs: list[torch.Tensor], rec: dict[str, Any]) -> torch.cuda.CUDAGraph:
    """Capture fn, then for each input of xs (one shape): copy it into the static input, replay, compare with
    eager."""
    device = xs[0].device
    static_x = torch.zeros_like(xs[0])
    graph, static_out = capture(fn, static_x, device)
    diffs = []
    for x in xs:
        static_x.copy_(x)
        graph.replay()
        torch.cuda.synchronize(device)
        diffs.append(max_diff(static_out, eager(x)))
    rec[f"graph_of_{what}_replays"] = len(xs)
    rec[f"graph_of_{what}_vs_eager"] = check_close(f"a CUDA graph of the {what} module, replayed,", diffs)
    return graph


def stage_exchange_graph(check: Check, rec: dict[str, Any]) -> None:
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32: the comparisons are to TOL
    try:
        run_exchange_graph(check, rec)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


def run_exchange_graph(check: Check, rec: dict[str, Any]) -> None:
    device = check.device
    with world_of_one(device) as name, torch.no_grad():
        torch.manual_seed(0)
        module = Exchanged(HIDDEN).to(device).eval()
        rec.update(backend=dist.get_backend(), hidden=HIDDEN, tokens=TOKENS[0], dtype="float32", tolerance=TOL,
                   capture_error_mode=CAPTURE_MODE)
        compiled = compare_eager_and_compiled(module, name, device, rec)

        into = copy.deepcopy(module)
        into.into = True

        def calling(m: Callable[..., torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
            return lambda x: m(x, name)

        eager = calling(module)
        runs = {"eager": eager, "compiled": calling(compiled), "eager_into": calling(into)}
        xs = inputs(module, TOKENS, device, seed=2)
        graphs = {what: replay_against_eager(what, fn, eager, xs, rec) for what, fn in runs.items()}
        x = inputs(module, TOKENS[:1], device, seed=3)[0]
        rec["eager_call_us"] = median_call_us(lambda: eager(x), check.sync)
        rec["compiled_call_us"] = median_call_us(lambda: runs["compiled"](x), check.sync)
        for what, graph in graphs.items():
            rec[f"graph_of_{what}_replay_us"] = median_call_us(graph.replay, check.sync)
        if X._pending:
            raise RuntimeError(f"{len(X._pending)} exchange(s) started and never waited")

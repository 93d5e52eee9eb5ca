"""The exchange as custom ops (models/serving/exchange_ops.py) on the CPU: registered under dtp_layout,
fake kernels that give the real shapes, opaque to torch.compile(fullgraph=True) (inductor in a world of 1,
aot_eager in a gloo world of 2 processes), and the numbers of a plain all-reduce in both worlds. The CUDA
side (side stream, events, a CUDA graph capturing the pair) is `make gpu-check`'s exchange-graph stage
(bench/gpu_exchange.py)."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch._inductor.utils import run_and_get_code
from torch._subclasses.fake_tensor import FakeTensorMode

from bench.gpu_exchange import Exchanged, reference  # the module the GPU stage captures, and its plain twin
from models.serving import exchange_ops as X
from tests.models.serving.vllm_kit import REPO, VLLM_PYTHON, vllm_missing

D = 32


def module_and_inputs(seed: int, *, into: bool = False) -> tuple[Exchanged, list[torch.Tensor]]:
    torch.manual_seed(0)  # the same weights on every rank
    module = Exchanged(D, into=into).eval()
    g = torch.Generator().manual_seed(seed)  # each rank its own tokens
    return module, [torch.randn(t, D, generator=g) for t in (5, 3, 8)]  # token counts vary, as in serving


@pytest.fixture(scope="module")
def world1() -> Iterator[str]:
    """A gloo world of one (this process): the group's name."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{Path(tmp) / 'store'}", rank=0, world_size=1)
        try:
            yield dist.distributed_c10d._get_default_group().group_name
        finally:
            dist.destroy_process_group()


def test_the_ops_are_registered_functional_under_dtp_layout():
    start, wait = torch.ops.dtp_layout.exchange_start.default, torch.ops.dtp_layout.exchange_wait.default
    assert str(start._schema) == "dtp_layout::exchange_start(Tensor t, str group_name) -> Tensor"
    assert str(wait._schema) == "dtp_layout::exchange_wait(Tensor handle) -> Tensor"
    assert not start._schema.is_mutable and not wait._schema.is_mutable
    into = torch.ops.dtp_layout.exchange_wait_into.default
    assert str(into._schema) == "dtp_layout::exchange_wait_into(Tensor handle, Tensor(a1!) out) -> ()"
    assert into._schema.is_mutable  # out, and only out (the handle is never copied by functionalisation)
    assert X.SPLITTING_OPS == ("dtp_layout::exchange_start", "dtp_layout::exchange_wait",
                               "dtp_layout::exchange_wait_into")


def test_opcheck_start(world1):
    """torch.library.opcheck: schema, autograd registration, fake kernel against the real one, AOT dispatch.
    (wait is not opchecked: opcheck calls an op on copies of its arguments, and a copy of a handle is not a
    handle, which wait refuses; its fake kernel is checked below and under torch.compile.)"""
    x = torch.randn(4, D)
    for args in ((x, world1), (x.T, world1), (x.to(torch.bfloat16), world1)):
        torch.library.opcheck(torch.ops.dtp_layout.exchange_start.default, args)
    X._pending.clear()  # opcheck's starts are never waited


def test_fake_kernels_give_the_real_shapes():
    with FakeTensorMode():
        x = torch.empty(7, 3, D, dtype=torch.bfloat16)
        for t in (x, x.transpose(0, 2)):  # a non-contiguous input: the real kernel's output is contiguous
            handle = torch.ops.dtp_layout.exchange_start(t, "no group is resolved by the fake kernel")
            total = torch.ops.dtp_layout.exchange_wait(handle)
            for out in (handle, total):
                assert out.shape == t.shape and out.dtype == torch.bfloat16 and out.is_contiguous()
            assert torch.ops.dtp_layout.exchange_wait_into(handle, torch.empty_like(t)) is None
    meta = torch.ops.dtp_layout.exchange_wait(torch.ops.dtp_layout.exchange_start(torch.empty(2, D, device="meta"),
                                                                                 "unused"))
    assert meta.device.type == "meta" and meta.shape == (2, D)


def test_eager_in_a_world_of_one_is_a_plain_all_reduce(world1):
    module, inputs = module_and_inputs(seed=1)
    with torch.no_grad():
        for x in inputs:
            torch.testing.assert_close(module(x, world1), reference(module, x), rtol=0, atol=0)
        handle = X.start(inputs[0], world1)
        assert X.wait(handle) is not handle  # the sum is a new tensor: the handle is the op's own
    assert X._pending == {}


def test_waits_that_no_start_matches_are_refused(world1):
    with pytest.raises(X.ExchangeError, match="no exchange_start returned"):
        X.wait(torch.zeros(3))
    handle = X.start(torch.ones(3), world1)
    X.wait(handle)
    with pytest.raises(X.ExchangeError, match="or one already waited"):
        X.wait(handle)
    handle = X.start(torch.ones(3), world1)
    with pytest.raises(X.ExchangeError, match=r"out is shaped \(4,\), the exchange \(3,\)"):
        X.wait_into(handle, torch.zeros(4))
    X.wait_into(handle, torch.zeros(3))  # the refusal left the exchange to be waited
    with pytest.raises(X.ExchangeError, match="no process group is named 'tp-nowhere'"):
        X.start(torch.ones(3), "tp-nowhere")


@pytest.mark.parametrize("into", [False, True], ids=["wait", "wait_into"])
def test_compiled_fullgraph_equals_eager_and_keeps_the_ops_opaque(world1, into):
    module, inputs = module_and_inputs(seed=2, into=into)
    compiled = torch.compile(module, fullgraph=True, dynamic=True)
    with torch.no_grad():
        got, codes = run_and_get_code(compiled, inputs[0], world1)
        rest = [compiled(x, world1) for x in inputs[1:]]  # other token counts: the same (dynamic) graph
        for x, out in zip(inputs, [got, *rest], strict=True):
            torch.testing.assert_close(out, module(x, world1), rtol=1e-6, atol=1e-6)
    code = "\n".join(codes)
    # called as they are in the generated code: not traced into, not decomposed
    for op in ("exchange_start", "exchange_wait_into" if into else "exchange_wait"):
        assert f"torch.ops.dtp_layout.{op}.default(" in code, op
    assert X._pending == {}


def _rank(rank: int, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        name = dist.distributed_c10d._get_default_group().group_name
        module, inputs = module_and_inputs(seed=10 + rank)  # each rank's own tokens, the same weights
        into = Exchanged(D, into=True).eval()
        into.load_state_dict(module.state_dict())
        # aot_eager: dynamo, the fake kernels and AOT's functionalization as inductor gets them; inductor's own
        # code generation is read in the world of one, and a C++ compile per rank would double the test's time
        compiled = torch.compile(module, fullgraph=True, dynamic=True, backend="aot_eager")
        compiled_into = torch.compile(into, fullgraph=True, dynamic=True, backend="aot_eager")
        results: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for i, x in enumerate(inputs):
                results[f"reference/{i}"] = reference(module, x)
                results[f"eager/{i}"] = module(x, name)
                results[f"compiled/{i}"] = compiled(x, name)
                results[f"eager_into/{i}"] = into(x, name)
                results[f"compiled_into/{i}"] = compiled_into(x, name)
            # two exchanges in flight at once, waited in the other order than they started
            a, b = inputs[0], 2 * inputs[0]
            ha, hb = X.start(a, name), X.start(b, name)
            results["second_first"] = torch.stack([X.wait(hb), X.wait(ha)])
            results["own"] = a
        results["left_pending"] = torch.tensor(len(X._pending))
        torch.save(results, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_a_gloo_world_of_two_sums_over_the_ranks_eager_and_compiled(tmp_path):
    out = tmp_path / "results"
    mp.spawn(_rank, args=(str(tmp_path / "store"), str(out)), nprocs=2, join=True)
    ranks = [torch.load(f"{out}.{r}", weights_only=True) for r in range(2)]
    for got in ranks:
        assert int(got["left_pending"]) == 0
        for i in range(3):
            torch.testing.assert_close(got[f"eager/{i}"], got[f"reference/{i}"], rtol=0, atol=0)
            for variant in ("compiled", "eager_into", "compiled_into"):
                torch.testing.assert_close(got[f"{variant}/{i}"], got[f"eager/{i}"], rtol=1e-6, atol=1e-6)
    # the sum really is over both ranks' tokens (each rank's own differ), written out: a + a', 2a + 2a'
    both = ranks[0]["own"] + ranks[1]["own"]
    for got in ranks:
        torch.testing.assert_close(got["second_first"], torch.stack([2 * both, both]), rtol=0, atol=1e-6)
    assert not torch.equal(ranks[0]["eager/0"], ranks[1]["eager/0"])  # each rank keeps its own y and own


VLLM_SPLIT = """
import json, sys, tempfile, torch, torch.distributed as dist
from vllm.compilation.backends import split_graph
from vllm.config import CompilationConfig
from bench.gpu_exchange import Exchanged
from models.serving import exchange_ops as X
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
name = dist.distributed_c10d._get_default_group().group_name
captured = []
def backend(gm, example_inputs):
    captured.append((gm, example_inputs))
    return gm.forward
torch.manual_seed(0)
module, x = Exchanged(16, into=True).eval(), torch.randn(4, 16)
with torch.no_grad():
    want = module(x, name)
    torch.compile(module, fullgraph=True, backend=backend)(x, name)
    gm, example = captured[0]
    split, items = split_graph(gm, CompilationConfig._attention_ops + list(X.SPLITTING_OPS))
    got = split(*example)
got = got[0] if isinstance(got, (tuple, list)) else got
pieces = [[str(n.target) for n in getattr(split, i.submod_name).graph.nodes if n.op == "call_function"]
          for i in items]
print(json.dumps({"pieces": pieces, "splitting": [i.is_splitting_graph for i in items],
                  "equal": bool(torch.equal(got, want)), "pending": len(X._pending)}))
"""


@pytest.mark.vllm
@pytest.mark.skipif(vllm_missing() is not None, reason=vllm_missing() or "")
def test_vllms_piecewise_split_runs_the_ops_between_its_pieces():
    """vLLM's own graph splitting (.venv-vllm) with SPLITTING_OPS beside its attention ops: each op is a piece of
    its own, run between the compiled ones, wait_into's buffer is allocated in the piece before it (where a
    piecewise CUDA graph finds it at every replay), and the split module gives eager's numbers."""
    done = subprocess.run([str(VLLM_PYTHON), "-c", VLLM_SPLIT], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["equal"] and got["pending"] == 0
    assert got["splitting"] == [False, True, False, True, False]
    first, start, middle, wait, last = got["pieces"]  # dynamo's graph: the ops as packets, torch functions
    assert start == ["dtp_layout.exchange_start"] and wait == ["dtp_layout.exchange_wait_into"]
    assert ["linear" in op for op in first] == [True] and ["sub" in op or "add" in op for op in last] == [True] * 2
    assert any("empty_like" in op for op in middle) and any("linear" in op for op in middle)

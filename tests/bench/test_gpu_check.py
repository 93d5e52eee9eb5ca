"""bench/gpu_check.py at its tiny size on the CPU: the same code path as the GPU run (every stage, the
files, the gpu tests with the CPU standing in), and its promises about time: a stage that cannot fit
is skipped and says so, and a run that hangs is stopped by the watchdog with its files written."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from bench import gpu_check
from tests.patience_kit import patient

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "gpu_check.py"
STAGES = ["model", "affinity", "optimise", "export", "forward", "distill"]
# The tiny runs' budget: the script's default (380 s) stretched by the machine's load. Its watchdog ends the
# process it runs in past the budget, and these runs are in pytest's own process.
TINY_BUDGET = ["--budget-s", str(round(patient(380)))]


def run(*args: str, timeout: float) -> tuple[subprocess.CompletedProcess[str], float]:
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)
    return done, time.monotonic() - t0


def results(out: Path) -> dict:
    return json.loads((out / gpu_check.JSON_FILE).read_text())


def test_tiny_run_goes_through_every_stage_and_the_gpu_tests(tmp_path, capsys):
    code = gpu_check.main(["--tiny", "--out", str(tmp_path), "--device", "cpu", *TINY_BUDGET])
    assert code == gpu_check.EXIT_OK, capsys.readouterr().out[-3000:]
    res = results(tmp_path)
    assert res["format"] == gpu_check.FORMAT and res["mode"] == "tiny" and res["status"] == "ok"
    stages = res["stages"]
    assert [name for name in stages] == [*STAGES, "tests"]
    # no GPU here: not skipped stages
    assert set(res["not_applicable"]) == {"distill-sharded", "exchange-graph", "serve-vllm"}
    assert all(stages[name]["status"] == "ok" for name in stages), stages
    sizes = gpu_check.TINY
    assert stages["model"]["layers"] == sizes.layers and stages["model"]["dtype"] == "bfloat16"
    aff = stages["affinity"]
    assert aff["tokens"] == sizes.calib_sequences * sizes.calib_seq_len and aff["finite"] is True
    assert aff["seconds"] > 0 and aff["ratio_to_forward"] > 0
    opt = stages["optimise"]
    assert opt["layouts"] == 2 + sizes.random_layouts  # optimised, contiguous and the random ones
    assert opt["J_optimised"] >= max(opt["J_contiguous"], opt["J_random_mean"]) and opt["J_over_bound"] <= 1 + 1e-9
    assert stages["export"]["tensors_verified"] > 0 and stages["export"]["shards"] == sizes.devices
    assert stages["forward"]["ratio"] > 0 and stages["forward"]["tokens"] == sizes.forward_batch * sizes.forward_seq
    dist = stages["distill"]
    assert dist["steps_done"] == sizes.distill_steps and len(dist["steps"]) == sizes.distill_steps
    assert all(math.isfinite(v) for step in dist["steps"] for v in step.values())
    assert dist["recipe"]["ce_weight"] == 0.1 and dist["recipe"]["betas"] == [0.9, 0.95]  # the paper's recipe
    assert dist["projected_1000_steps_s"] > 1000 * dist["step_s"]
    tests = stages["tests"]
    assert tests["failed"] == 0 and tests["errors"] == 0 and tests["passed"] >= 20, tests
    assert "CPU standing in" in tests["note"]
    assert (tmp_path / gpu_check.TESTS_XML).is_file() and "passed" in (tmp_path / gpu_check.TESTS_LOG).read_text()
    md = (tmp_path / gpu_check.MD_FILE).read_text()
    assert md.startswith("# GPU check (tiny): ok") and "| affinity pass, 8×32 tokens |" in md
    assert "| `gpu` tests | " in md and "| 51 s |" in md and "| 22–32 min |" in md


def test_a_budget_too_small_skips_every_stage_and_says_why(tmp_path):
    assert gpu_check.main(["--tiny", "--out", str(tmp_path), "--device", "cpu", "--budget-s", "0"]) == (
        gpu_check.EXIT_BUDGET)
    res = results(tmp_path)
    assert res["status"] == "partial"
    assert {name: rec["status"] for name, rec in res["stages"].items()} == {
        **{name: "skipped" for name in STAGES}, "tests": "skipped"}
    assert res["stages"]["model"]["reason"].startswith("time budget")
    assert res["stages"]["affinity"]["reason"] == "needs stage model, which did not run"
    md = (tmp_path / gpu_check.MD_FILE).read_text()
    assert "**skipped**: time budget" in md
    # no GPU: the multi-GPU stages are not applicable, whatever the budget, and the report says why
    assert res["not_applicable"]["serve-vllm"] == "no GPU visible; vLLM TP=2 needs 2 (NCCL)"
    assert "distill-sharded" in res["not_applicable"] and "serve-vllm" not in res["stages"]
    assert "| vLLM at TP=2 on the exported shards (tiny fp32 llama, dtp:1) | not applicable | — | — | no GPU " in md
    assert "Not applicable here: distill-sharded (" in md and "serve-vllm (no GPU visible; vLLM TP=2 needs 2" in md
    assert res["not_applicable"]["exchange-graph"].startswith("no CUDA GPU (device cpu, torch ")
    row = "| exchange ops in a CUDA graph (1 GPU, NCCL), replayed vs eager |"
    assert f"{row} not applicable | — | — | no CUDA GPU" in md


@pytest.mark.serial  # a wall-time bound (< 60 s)
def test_the_watchdog_stops_a_hung_run_and_leaves_its_files(tmp_path):
    done, wall = run("--tiny", "--out", str(tmp_path), "--device", "cpu", "--skip-tests", "--budget-s", "3",
                     "--grace-s", "0.5", "--hang-in", "model", timeout=patient(120))
    assert done.returncode == gpu_check.EXIT_WATCHDOG, done.stdout + done.stderr
    assert wall < patient(60)  # startup (imports; longer when busy) + the 3.5 s of budget and grace, not the hang
    res = results(tmp_path)
    assert res["status"] == "timed out" and res["timed_out_in"] == "model" and res["elapsed_s"] >= 3.5
    assert "Stopped in stage model." in (tmp_path / gpu_check.MD_FILE).read_text()


def test_the_full_size_refuses_to_run_without_cuda(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: False)
    assert gpu_check.main(["--out", str(tmp_path)]) == gpu_check.EXIT_NO_CUDA
    res = results(tmp_path)
    assert res["status"] == "no CUDA" and "--tiny" in res["error"] and res["stages"] == {}


def test_the_w_gpu_distillation_applies_only_with_two_gpus_or_more():
    cpu, cuda = __import__("torch").device("cpu"), __import__("torch").device("cuda", 0)
    for gpus in (0, 1):
        world, why = gpu_check.sharded_world_size(cuda, None, gpus)
        assert world == 0 and "needs at least 2" in why
    assert gpu_check.sharded_world_size(cpu, None, 0)[0] == 0  # no GPU: not applicable, not a skipped stage
    assert gpu_check.sharded_world_size(cuda, None, 4) == (4, None)  # every visible GPU
    assert gpu_check.sharded_world_size(cuda, 2, 4) == (2, None)
    assert "only 4 GPU(s)" in gpu_check.sharded_world_size(cuda, 8, 4)[1]
    assert gpu_check.sharded_world_size(cpu, 2, 0) == (2, None)  # gloo ranks on the CPU (the test below)
    assert gpu_check.parse_args(["--out", "x", "--world-size", "2"]).world_size == 2


def test_tiny_run_with_two_gloo_ranks_runs_the_sharded_distillation(tmp_path, capsys):
    code = gpu_check.main(["--tiny", "--out", str(tmp_path), "--device", "cpu", "--skip-tests", "--world-size", "2",
                           "--budget-s", str(round(patient(600)))])
    assert code == gpu_check.EXIT_OK, capsys.readouterr().out[-3000:]
    stage = results(tmp_path)["stages"]["distill-sharded"]
    assert stage["status"] == "ok" and stage["world_size"] == 2, stage
    assert stage["max_loss_diff"] <= 1e-5 and len(stage["runs"]["2"]["losses"]) == stage["steps"]


def test_vllm_serving_applies_only_with_two_gpus_and_vllm():
    from bench import gpu_multi

    def never(*_args):
        raise AssertionError("not asked for when too few GPUs are visible")

    assert gpu_multi.serving_applicable(0, find=never) == (None, "no GPU visible; vLLM TP=2 needs 2 (NCCL)")
    assert gpu_multi.serving_applicable(1, find=never) == (None, "1 GPU visible; vLLM TP=2 needs 2 (NCCL)")
    python, why = gpu_multi.serving_applicable(2, find=lambda: None)
    assert python is None and why.startswith("vLLM is not installed: no interpreter with vllm")
    why = gpu_multi.serving_applicable(2, find=lambda: "py", probe=lambda _p: {"error": "py cannot import vllm: X"})[1]
    assert why == "vLLM is not usable: py cannot import vllm: X"
    why = gpu_multi.serving_applicable(4, find=lambda: "py", probe=lambda _p: {"gpus": 1, "torch": "2.9.0+cpu"})[1]
    assert why == "vLLM's torch (py: torch 2.9.0+cpu) sees 1 GPU(s); TP=2 needs 2"
    why = gpu_multi.serving_applicable(2, find=lambda: "py", probe=lambda _p: {"gpus": 2, "plugin": False})[1]
    assert why.startswith("vLLM's environment (py) lacks the dtp-layout plugin")
    assert gpu_multi.serving_applicable(2, find=lambda: "py", probe=lambda _p: {"gpus": 2, "plugin": True}) == (
        "py", None)


def test_the_serving_stage_compares_vllms_tokens_with_generates(tmp_path, monkeypatch):
    """The stage's plumbing without vLLM: a tiny model exported, `dtp-layout generate` on a batch of prompts
    (gloo ranks here), and a stand-in server whose tokens differ: the stage fails naming both."""
    import pytest

    from bench import gpu_multi
    from tests.models.serving import vllm_kit

    class FakeServer:
        def __init__(self, shards, **kwargs):
            assert (shards / "manifest.json").is_file() and kwargs["tp"] == 2 and kwargs["python"] == "py"
            self.start_s = 0.5

        def complete(self, prompts, max_tokens):
            return [[0] * max_tokens for _ in prompts]

        def stop(self):
            pass

    class FakeCheck:
        out, tests_reserve_s = tmp_path, 0.0

        def remaining(self):
            return 600.0

        def timed(self, fn):
            return 0.0, fn()

    monkeypatch.setattr(vllm_kit, "Server", FakeServer)
    monkeypatch.setattr(gpu_multi, "probe_vllm", lambda _p: {"vllm": "0.0-fake", "torch": "x", "gpus": 2})
    rec: dict = {}
    with pytest.raises(RuntimeError, match="differ from dtp-layout generate's"):
        gpu_multi.stage_serve_vllm(FakeCheck(), "py", rec)  # type: ignore[arg-type]
    want = rec["generate_tokens"]
    assert len(want) == gpu_multi.SERVE_PROMPTS and {len(row) for row in want} == {gpu_multi.SERVE_NEW_TOKENS}
    assert rec["tokens_equal"] is False and rec["vllm"] == "0.0-fake" and rec["start_s"] == 0.5


def test_the_exchange_graph_stage_applies_only_with_cuda_and_nccl(monkeypatch):
    from bench import gpu_exchange

    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert "CUDA graphs capture CUDA streams alone" in gpu_exchange.not_applicable(cpu)
    monkeypatch.setattr(gpu_exchange.torch.cuda, "is_available", lambda: False)
    assert gpu_exchange.not_applicable(cuda).startswith("no CUDA GPU (device cuda:0")
    monkeypatch.setattr(gpu_exchange.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_exchange.dist, "is_nccl_available", lambda: False)
    assert "has no NCCL backend" in gpu_exchange.not_applicable(cuda)
    monkeypatch.setattr(gpu_exchange.dist, "is_nccl_available", lambda: True)
    assert gpu_exchange.not_applicable(cuda) is None


def test_the_exchange_graph_stages_comparisons_run_on_the_cpu():
    """Everything of the stage but the capture, in a gloo world of one: eager with the ops against a blocking
    all-reduce, torch.compile(fullgraph=True) against eager; and a difference fails the stage, named."""
    from bench import gpu_exchange

    cpu = torch.device("cpu")
    rec: dict = {}
    with gpu_exchange.world_of_one(cpu) as name, torch.no_grad():
        torch.manual_seed(0)
        module = gpu_exchange.Exchanged(64).eval()
        gpu_exchange.compare_eager_and_compiled(module, name, cpu, rec)
        assert rec["eager_vs_reference"] == 0 and rec["compiled_vs_eager"] <= gpu_exchange.TOL and rec["compile_s"] > 0
        with pytest.raises(RuntimeError, match="already initialised"), gpu_exchange.world_of_one(cpu):
            pass
    with pytest.raises(RuntimeError, match=r"a CUDA graph of the eager module, replayed, differs from eager by 0.001"):
        gpu_exchange.check_close("a CUDA graph of the eager module, replayed,", [0.0, 1e-3])


def test_the_report_shows_a_captured_exchange():
    """The exchange-graph row as a GPU run writes it (its figures are made up: the row's wording is tested)."""
    from bench.gpu_report import markdown

    rec = {"status": "ok", "tokens": 8, "hidden": 1024, "eager_vs_reference": 0.0, "compiled_vs_eager": 2e-7,
           "graph_of_eager_vs_eager": 0.0, "graph_of_compiled_vs_eager": 1e-7, "graph_of_eager_into_vs_eager": 0.0,
           "eager_call_us": 120.0, "compiled_call_us": 90.0, "graph_of_eager_replay_us": 30.0,
           "graph_of_compiled_replay_us": 25.0, "graph_of_eager_into_replay_us": 31.0, "compile_s": 9.5}
    results = {"mode": "full", "status": "ok", "started": "now", "elapsed_s": 1.0, "budget_s": 380, "command": "x",
               "sizes": gpu_check.asdict(gpu_check.FULL), "stages": {"exchange-graph": rec}}
    md = markdown(results)
    assert ("| exchange ops in a CUDA graph (1 GPU, NCCL), replayed vs eager | equal (max diff 1e-07) | — | — | "
            "8×1024 fp32; one call: eager 120.0 µs, compiled 90.0 µs, graph of eager 30.0 µs, graph of compiled "
            "25.0 µs, graph of eager with wait_into 31.0 µs; eager = blocking all-reduce to 0, compiled = eager to "
            "2e-07 |") in md
    failed = markdown({**results, "stages": {"exchange-graph": {"status": "failed", "error": "RuntimeError: boom"}}})
    assert "replayed vs eager | **failed**: RuntimeError: boom | — | — |  |" in failed

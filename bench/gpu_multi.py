"""The stages of bench/gpu_check.py that need two GPUs or more: the W-GPU distillation (FSDP2 over NCCL) and
vLLM serving the exported shards at TP = 2 (issue 28). Each applies or says why not; gpu_check records the
reason under `not_applicable` (not a skipped stage: nothing ran out of budget).

    serve-vllm  a tiny fp32 llama (2 layers, 4 heads of 32) exported as 2 rank shards under dtp:1; vLLM's
                OpenAI server on them at --tensor-parallel-size 2 (eager, NCCL) and `dtp-layout generate`
                on the same shards (one NCCL rank per GPU): the greedy tokens of a batch of prompts must be
                equal. The interpreter with vLLM: DTP_LAYOUT_VLLM_PYTHON, else .venv-vllm, else the check's
                own, with the dtp-layout-vllm wheel installed in it (the plugin's entry point); without one, or with
                fewer than 2 GPUs visible, not applicable. vLLM's log goes to OUT/gpu_serving_vllm.log.
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from bench.gpu_check import Check

REPO = Path(__file__).resolve().parent.parent
SERVE_TP = 2
SERVE_SCHEDULE = "dtp:1"
SERVE_PROMPTS, SERVE_PROMPT_LEN, SERVE_NEW_TOKENS = 3, 16, 12
VLLM_LOG = "gpu_serving_vllm.log"


def random_blocks(n: int, seq: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(seed))  # [n, S]


# ---- the W-GPU distillation ------------------------------------------------------------------------

def sharded_world_size(device: torch.device, requested: int | None, gpus: int) -> tuple[int, str | None]:
    """The W of the sharded-distillation stage and, when it does not apply, why: it runs on W > 1 GPUs
    (all of them unless --world-size says fewer); --world-size on the CPU runs gloo ranks (the tests)."""
    if device.type != "cuda":
        if requested and requested > 1:
            return requested, None
        return 0, "no GPU: the W-GPU distillation needs at least 2 (--world-size W runs gloo ranks on the CPU)"
    world = requested or gpus
    if gpus < 2 or world < 2:
        return 0, f"{gpus} GPU(s) visible: the W-GPU distillation needs at least 2"
    if world > gpus:
        return 0, f"--world-size {world} but only {gpus} GPU(s) visible"
    return world, None


def stage_distill_sharded(check: Check, model: Any, world_size: int, rec: dict[str, Any]) -> None:
    """The same few distillation steps at W = 1 and on W ranks (FSDP2; NCCL on GPUs): step times, and the
    largest loss difference (the W-rank curve must be the W = 1 one)."""
    from models import distill as D
    from models.families import model_shape
    from models.layouts import layout as lay

    s = check.sizes
    batch = max(world_size, s.recipe.get("batch_size", 16) // world_size * world_size)
    micro = min(batch // world_size, s.recipe.get("micro_batch_size", 4))
    recipe = D.DistillRecipe(**{**s.recipe, "batch_size": batch, "micro_batch_size": micro,
                                "steps": s.distill_steps + 1, "eval_every": s.distill_steps + 1,
                                "warmup_steps": 1})
    vocab = model.config.vocab_size
    train = random_blocks(recipe.steps * batch, s.seq_len, vocab, seed=3).to(check.device)  # [steps·B, S]
    reference = D.DenseReference.compute(model, random_blocks(2, s.seq_len, vocab, seed=4).to(check.device),
                                         recipe=recipe)
    layout = lay.contiguous(model_shape(model.config), s.devices, s.delta)
    runs: dict[int, dict[str, Any]] = {}
    for w in (1, world_size):
        stamps: list[float] = []
        losses: list[float] = []

        def on_step(stats: Any, _last: Any, stamps: list[float] = stamps, losses: list[float] = losses) -> None:
            check.sync()
            stamps.append(time.perf_counter())
            losses.append(stats.loss)

        with tempfile.TemporaryDirectory() as tmp:
            seconds, _ = check.timed(functools.partial(
                D.distill_run, teacher=model, layout=layout, seed=0, recipe=recipe, train_blocks=train,
                reference=reference, run_dir=Path(tmp) / "run", on_step=on_step, world_size=w))
        gaps = [b - a for a, b in itertools.pairwise(stamps)]
        runs[w] = {"seconds": round(seconds, 3), "step_s": round(statistics.median(gaps), 4) if gaps else None,
                   "losses": [round(v, 6) for v in losses]}
    diff = max(abs(a - b) for a, b in zip(runs[1]["losses"], runs[world_size]["losses"], strict=True))
    rec.update(world_size=world_size, batch_size=batch, steps=recipe.steps, runs={str(k): v for k, v in runs.items()},
               max_loss_diff=diff)
    if runs[1]["step_s"] and runs[world_size]["step_s"]:
        rec["step_ratio_vs_w1"] = round(runs[world_size]["step_s"] / runs[1]["step_s"], 3)
    if not diff <= 1e-3:  # bf16 autocast on GPUs: the ranks' micro-batches round differently, not this much
        raise RuntimeError(f"W={world_size} losses differ from W=1 by {diff}")


# ---- vLLM serving at TP = 2 ------------------------------------------------------------------------

def vllm_python() -> str | None:
    """The interpreter with vLLM: DTP_LAYOUT_VLLM_PYTHON, .venv-vllm beside the project, or this one."""
    for candidate in (os.environ.get("DTP_LAYOUT_VLLM_PYTHON"), str(REPO / ".venv-vllm" / "bin" / "python")):
        if candidate and Path(candidate).is_file():
            return candidate
    return sys.executable if importlib.util.find_spec("vllm") is not None else None


def probe_vllm(python: str) -> dict[str, Any]:
    """vLLM's version and the GPUs its torch sees, from `python` (an error string under `error`)."""
    code = ("import json, torch, vllm; from importlib.metadata import entry_points; print(json.dumps({"
            "'vllm': vllm.__version__, 'torch': torch.__version__, "
            "'gpus': torch.cuda.device_count() if torch.cuda.is_available() else 0, "
            "'plugin': any(e.name == 'dtp_layout' for e in entry_points(group='vllm.general_plugins'))}))")
    try:
        done = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=180)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"error": f"{python}: {type(exc).__name__}: {exc}"}
    if done.returncode != 0:
        return {"error": f"{python} cannot import vllm: {(done.stderr.strip().splitlines() or ['?'])[-1]}"}
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def serving_applicable(gpus: int, *, find: Callable[[], str | None] = vllm_python,
                       probe: Callable[[str], dict[str, Any]] = probe_vllm) -> tuple[str | None, str | None]:
    """(the interpreter with vLLM, None) when the serving stage applies, else (None, why not)."""
    if gpus < SERVE_TP:
        seen = "no GPU visible" if gpus == 0 else f"{gpus} GPU visible"
        return None, f"{seen}; vLLM TP={SERVE_TP} needs {SERVE_TP} (NCCL)"
    python = find()
    if python is None:
        return None, ("vLLM is not installed: no interpreter with vllm (DTP_LAYOUT_VLLM_PYTHON, .venv-vllm, or "
                      f"{sys.executable}); docs/serving.md, Install")
    info = probe(python)
    if "error" in info:
        return None, f"vLLM is not usable: {info['error']}"
    if int(info.get("gpus", 0)) < SERVE_TP:
        return None, (f"vLLM's torch ({python}: torch {info.get('torch')}) sees {info.get('gpus', 0)} GPU(s); "
                      f"TP={SERVE_TP} needs {SERVE_TP}")
    if not info.get("plugin", True):
        return None, (f"vLLM's environment ({python}) lacks the dtp-layout plugin: pip install the dtp-layout-vllm "
                      "wheel of `make dist` in it (docs/serving.md, Install)")
    return python, None


def generate_tokens(shards: Path, prompts: list[list[int]], new_tokens: int, *, timeout_s: float) -> list[list[int]]:
    """`dtp-layout generate --ids … --json` on the batch (its ranks on one GPU each: NCCL), greedy, no EOS stop."""
    import numpy as np

    ids = shards.parent / "prompts.npy"
    np.save(ids, np.asarray(prompts, dtype=np.int64))
    cmd = [sys.executable, "-m", "app.cli.main", "generate", str(shards), "--ids", str(ids), "--max-new-tokens",
           str(new_tokens), "--ignore-eos", "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=str(REPO),
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    if done.returncode:
        raise RuntimeError(f"dtp-layout generate failed ({done.returncode}): {done.stderr[-2000:]}")
    return [[int(t) for t in row] for row in json.loads(done.stdout.strip().splitlines()[-1])["generated_ids"]]


def stage_serve_vllm(check: Check, python: str, rec: dict[str, Any]) -> None:
    """vLLM at TP = 2 on a tiny model's shards; its greedy tokens equal `dtp-layout generate`'s."""
    from tests.models.serving.vllm_kit import Server, export_tiny

    info = probe_vllm(python)
    rec.update(python=python, vllm=info.get("vllm"), vllm_torch=info.get("torch"), tp=SERVE_TP,
               schedule=SERVE_SCHEDULE, prompts=SERVE_PROMPTS, prompt_len=SERVE_PROMPT_LEN,
               new_tokens=SERVE_NEW_TOKENS, dtype="float32", log=VLLM_LOG)
    with tempfile.TemporaryDirectory(prefix="dtp-gpu-check-serve-") as tmp:
        rec["export_s"], out = check.timed(lambda: export_tiny(Path(tmp) / "tiny", case="llama",
                                                               schedule=SERVE_SCHEDULE, devices=SERVE_TP))
        shards = out / "shards"
        prompts = random_blocks(SERVE_PROMPTS, SERVE_PROMPT_LEN, 257, seed=5).tolist()
        t0 = time.perf_counter()
        want = generate_tokens(shards, prompts, SERVE_NEW_TOKENS, timeout_s=max(30.0, check.remaining() / 2))
        rec["generate_s"] = round(time.perf_counter() - t0, 3)
        start_budget = max(30.0, check.remaining() - check.tests_reserve_s - 30)
        server = Server(shards, tp=SERVE_TP, python=python, log=check.out / VLLM_LOG, start_timeout_s=start_budget,
                        extra=["--gpu-memory-utilization", "0.3"])
        try:
            rec["start_s"] = round(server.start_s, 3)
            t0 = time.perf_counter()
            got = server.complete(prompts, SERVE_NEW_TOKENS)
            rec["request_s"] = round(time.perf_counter() - t0, 3)
        finally:
            server.stop()
    rec["tokens_equal"] = got == want
    if got != want:
        rec.update(vllm_tokens=got, generate_tokens=want)
        raise RuntimeError(f"vLLM's greedy tokens differ from dtp-layout generate's: {got} != {want}")

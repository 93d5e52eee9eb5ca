"""GPU readiness check: the CUDA path of the whole method at the paper's scale, unattended, into files.

On one GPU, a Qwen3-0.6B-shaped random model at full depth (28 layers) in bf16:

  affinity  the affinity pass over 64 × 1024 calibration tokens (micro-batches of 4), and the dense
            forward over the same tokens (ratio; target ≤ 2.5 as in bench/affinity.py)
  optimise  the layout optimiser at L=4, δ=1 (4 restarts) with 8 random layouts scored
  export    the optimised layout's permuted checkpoint and 4 rank shards, the shards read back and
            compared with the permuted weights
  forward   DTP (L=4, δ=1) vs dense forward on 4 × 1024 tokens (target ≤ 1.3 as in bench/dtp_forward.py)
  distill   20 steps of the paper's recipe (16 × 1024 tokens per step in micro-batches of 4, bf16
            autocast over fp32 master weights, AdamW) and one evaluation on 16 × 1024 tokens, from
            which a 1000-step run with an evaluation every 100 steps is projected
  exchange-graph  the exchange ops the vLLM plugin overlaps with (models/serving/exchange_ops.py) captured in a
            CUDA graph on one GPU (a world of one NCCL rank), replayed, and compared with eager, compiled
            or not (bench/gpu_exchange.py); without CUDA `not_applicable`, with the reason
  distill-sharded, serve-vllm   with 2 GPUs or more (bench/gpu_multi.py): the distillation on W GPUs
            (FSDP2, NCCL) against W = 1; vLLM at TP = 2 on a tiny model's exported shards, its greedy tokens
            against `dtp-layout generate`'s; elsewhere `not_applicable`, with the reason
  tests     the `gpu` tests (pytest -m gpu tests/gpu)

Every figure is printed next to the paper's (one RTX 5090, Qwen3-0.6B: affinity pass 51 s,
optimisation 38–47 s with eight random layouts scored, a 1000-step run 22–32 min). OUT/gpu_check.json
and OUT/gpu_check.md are rewritten after every stage, so a run cut short still leaves what it
measured; the tests' log and JUnit XML go beside them. The run keeps to --budget-s: a stage that
cannot fit is skipped and says so, the distillation stops early rather than overrun, the tests get
what is left, and a watchdog writes the files and exits (status 3) if anything hangs past the budget.

    make gpu-check OUT=DIR                            # bootstrap .venv-gpu, then this at full size
    .venv-gpu/bin/python bench/gpu_check.py --out DIR [--budget-s 380]
    .venv/bin/python bench/gpu_check.py --tiny --out DIR   # the same code path, tiny, CPU too

Exit status: 0 everything ran and passed; 1 a stage or a test failed; 2 no CUDA for the full size;
3 the watchdog stopped a run that hung past the budget; 4 the budget ran out before every stage ran.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.common import dtp_vs_dense_times, qwen3_06b_shaped  # noqa: E402
from bench.gpu_exchange import not_applicable as exchange_not_applicable  # noqa: E402
from bench.gpu_exchange import stage_exchange_graph  # noqa: E402
from bench.gpu_multi import (  # noqa: E402
    serving_applicable,
    sharded_world_size,
    stage_distill_sharded,
    stage_serve_vllm,
)
from bench.gpu_report import GIB, PAPER, PAPER_GPU, junit_counts, markdown  # noqa: E402

FORMAT = "dtp-layout-gpu-check/1"
JSON_FILE, MD_FILE = "gpu_check.json", "gpu_check.md"
TESTS_LOG, TESTS_XML = "gpu_tests.log", "gpu_tests.xml"
EXIT_OK, EXIT_FAILED, EXIT_NO_CUDA, EXIT_WATCHDOG, EXIT_BUDGET = 0, 1, 2, 3, 4


@dataclass(frozen=True)
class Sizes:
    """Everything the check's workload depends on; FULL is the issue's, TINY the CI one."""

    name: str
    layers: int
    model: dict[str, Any] = field(default_factory=dict)  # overrides of Qwen3-0.6B's dimensions
    calib_sequences: int = 64
    calib_seq_len: int = 1024
    affinity_batch: int = 4
    devices: int = 4
    delta: int = 1
    random_layouts: int = 8
    restarts: int = 4
    forward_batch: int = 4
    forward_seq: int = 1024
    forward_repeats: int = 5
    distill_steps: int = 20
    recipe: dict[str, Any] = field(default_factory=dict)  # overrides of the paper's DistillRecipe
    seq_len: int = 1024
    eval_sequences: int = 16
    tests_reserve_s: float = 150.0  # kept for the gpu tests when the stages before them run long


FULL = Sizes("full", layers=28)
TINY = Sizes("tiny", layers=2, model=dict(vocab_size=512, hidden_size=64, intermediate_size=128,
                                          num_attention_heads=8, num_key_value_heads=4, head_dim=16),
             calib_sequences=8, calib_seq_len=32, forward_batch=2, forward_seq=64, forward_repeats=2,
             distill_steps=2, recipe=dict(batch_size=4, micro_batch_size=2, eval_batch_size=2), seq_len=64,
             eval_sequences=4, tests_reserve_s=90.0)


class SkipStage(Exception):
    """The stage does not fit in the budget, or needs a stage that did not run."""


# ---- the run: results, files, budget, watchdog -------------------------------------------------

class Check:
    def __init__(self, *, out: Path, sizes: Sizes, device: torch.device, budget_s: float, grace_s: float,
                 command: str, tests: bool = True) -> None:
        self.out, self.sizes, self.device = out, sizes, device
        self.tests_reserve_s = sizes.tests_reserve_s if tests else 0.0
        self.budget_s, self.grace_s = budget_s, grace_s
        self.t0 = time.monotonic()
        self.current: str | None = None
        self.child: subprocess.Popen[bytes] | None = None  # the tests' pytest, while it runs
        self._lock = threading.RLock()  # re-entrant: the SIGTERM handler may interrupt a write
        self.results: dict[str, Any] = {
            "format": FORMAT, "mode": sizes.name, "command": command, "status": "running",
            "started": datetime.now(UTC).isoformat(timespec="seconds"), "budget_s": budget_s, "elapsed_s": 0.0,
            "sizes": asdict(sizes), "paper": {"gpu": PAPER_GPU, **{k: list(v) for k, v in PAPER.items()}},
            "environment": {}, "stages": {},
        }

    # -- time --
    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def remaining(self) -> float:
        return self.budget_s - self.elapsed()

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def timed(self, fn: Callable[[], Any]) -> tuple[float, Any]:
        self.sync()
        t0 = time.perf_counter()
        value = fn()
        self.sync()
        return time.perf_counter() - t0, value

    def peak_gib(self) -> float | None:
        if self.device.type != "cuda":
            return None
        return round(torch.cuda.max_memory_allocated(self.device) / GIB, 3)

    # -- stages --
    def run_stage(self, name: str, body: Callable[[dict[str, Any]], Any], *, needs: float = 0.0,
                  after: tuple[str, ...] = ()) -> Any:
        """body(record) if the stages in `after` ran and `needs` seconds (beyond the tests' reserve) are
        left; the record (what the body measured, its status, wall time, peak memory) goes to the files."""
        reserve = 0.0 if name == "tests" else self.tests_reserve_s
        left = self.remaining() - reserve
        missing = [dep for dep in after if not self.ran(dep)]
        if missing or left < needs:
            reason = (f"needs stage {', '.join(missing)}, which did not run" if missing else
                      f"time budget: {max(0.0, left):.0f} s left for it, needs about {needs:.0f}")
            self._record(name, {"status": "skipped", "reason": reason})
            log(f"{name}: skipped ({reason})")
            return None
        self.current = name
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        record: dict[str, Any] = {}
        value = None
        t0 = time.perf_counter()
        log(f"{name}: start ({self.remaining():.0f} s of budget left)")
        try:
            value = body(record)
            status = record.pop("status", "ok")
        except SkipStage as exc:
            status, record["reason"] = "skipped", str(exc)
        except Exception as exc:
            status = "failed"
            record["error"] = f"{type(exc).__name__}: {exc}"
            record["traceback"] = traceback.format_exc(limit=8)
            log(f"{name}: FAILED {record['error']}")
        record["wall_s"] = round(time.perf_counter() - t0, 3)
        if "peak_gib" not in record and self.peak_gib() is not None:
            record["peak_gib"] = self.peak_gib()
        self._record(name, {"status": status, **record})
        self.current = None
        log(f"{name}: {status} in {record['wall_s']:.1f} s")
        return value if status == "ok" else None

    def not_applicable(self, name: str, why: str) -> None:
        """The stage cannot run on this machine (not a skipped stage: nothing ran out of budget)."""
        with self._lock:
            self.results.setdefault("not_applicable", {})[name] = why
        log(f"{name}: not applicable ({why})")

    def ran(self, name: str) -> bool:
        return self.results["stages"].get(name, {}).get("status") == "ok"

    def _record(self, name: str, record: dict[str, Any]) -> None:
        with self._lock:
            self.results["stages"][name] = record
        self.write()

    # -- files --
    def write(self, status: str | None = None) -> None:
        with self._lock:
            if status is not None:
                self.results["status"] = status
            self.results["elapsed_s"] = round(self.elapsed(), 1)
            self.out.mkdir(parents=True, exist_ok=True)
            _atomic_write(self.out / JSON_FILE, json.dumps(self.results, indent=1, default=_json_default))
            _atomic_write(self.out / MD_FILE, markdown(self.results))

    def final_status(self) -> tuple[str, int]:
        stages = self.results["stages"].values()
        if any(s["status"] == "failed" for s in stages):
            return "failed", EXIT_FAILED
        if any(s["status"] == "skipped" for s in stages):
            return "partial", EXIT_BUDGET
        return "ok", EXIT_OK

    def start_watchdog(self) -> threading.Event:
        """Past budget + grace, write what there is and leave: a hung CUDA call cannot be interrupted.
        Setting the returned event stands the watchdog down."""
        done = threading.Event()

        def watch() -> None:
            if done.wait(max(0.0, self.t0 + self.budget_s + self.grace_s - time.monotonic())):
                return
            self.results["timed_out_in"] = self.current
            self.write(status="timed out")
            if self.child is not None and self.child.poll() is None:
                self.child.kill()
            log(f"watchdog: past the budget ({self.budget_s:.0f} s + {self.grace_s:.0f} s) in stage "
                f"{self.current}; results written to {self.out}")
            os._exit(EXIT_WATCHDOG)

        threading.Thread(target=watch, name="gpu-check-watchdog", daemon=True).start()
        return done

    def on_signal(self, signum: int, _frame: Any) -> None:
        self.results["interrupted_in"] = self.current
        self.write(status=f"interrupted by signal {signum}")
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(signal.SIGINT)
        os._exit(128 + signum)


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _json_default(value: Any) -> Any:
    if isinstance(value, float | int):
        return value
    return str(value)


def log(message: str) -> None:
    print(f"[gpu-check {time.strftime('%H:%M:%S')}] {message}", flush=True)


# ---- the stages --------------------------------------------------------------------------------

def environment(check: Check) -> dict[str, Any]:
    import numpy
    import transformers

    env: dict[str, Any] = {
        "device": str(check.device), "python": platform.python_version(), "torch": torch.__version__,
        "torch_cuda": torch.version.cuda, "transformers": transformers.__version__, "numpy": numpy.__version__,
        "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "platform": platform.platform(),
    }
    if check.device.type == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(check.device)
        env.update(gpu=props.name, capability=f"{props.major}.{props.minor}",
                   gpu_memory_gib=round(props.total_memory / GIB, 2), multiprocessors=props.multi_processor_count,
                   visible_gpus=torch.cuda.device_count())
        env["nvidia_smi"] = _nvidia_smi()
    return env


def _nvidia_smi() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm",
                               "--format=csv,noheader"], capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"nvidia-smi failed: {exc}"
    return done.stdout.strip() or done.stderr.strip()


def random_blocks(n: int, seq: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(seed))  # [n, S]


def stage_affinity(check: Check, model: Any, rec: dict[str, Any]) -> Any:
    from models.affinity.scoring import affinity_pass

    s = check.sizes
    blocks = random_blocks(s.calib_sequences, s.calib_seq_len, model.config.vocab_size, seed=1)  # [n, S]
    rec["tokens"] = int(blocks.numel())
    # One micro-batch first: CUDA context, cuBLAS handles and kernel selection stay out of the timing.
    rec["warmup_s"], _ = check.timed(lambda: affinity_pass(model, blocks[: s.affinity_batch],
                                                           batch_size=s.affinity_batch))
    seconds, result = check.timed(lambda: affinity_pass(model, blocks, batch_size=s.affinity_batch))
    rec["seconds"] = round(seconds, 3)
    rec["tokens_per_s"] = round(rec["tokens"] / seconds, 1)
    values = [m for part in (result.up_fo, result.up_add, result.down) for m in part]
    rec["finite"] = bool(all(math.isfinite(float(m.sum())) and float(m.min()) >= 0 for m in values))
    if not rec["finite"]:
        raise RuntimeError("the affinity matrices hold NaN, inf or negative values")

    def dense_forward() -> None:
        with torch.inference_mode():
            for start in range(0, blocks.shape[0], s.affinity_batch):
                model.model(blocks[start : start + s.affinity_batch].to(check.device))

    forward_s, _ = check.timed(dense_forward)
    rec["forward_s"] = round(forward_s, 3)
    rec["ratio_to_forward"] = round(seconds / forward_s, 3)
    return result


def stage_optimise(check: Check, affinity: Any, rec: dict[str, Any]) -> dict[str, Any]:
    from models.variants.set import build_layouts

    s = check.sizes
    seconds, layouts = check.timed(lambda: build_layouts(
        affinity, devices=s.devices, delta=s.delta, random_layouts=s.random_layouts, restarts=s.restarts))
    rec["seconds"] = round(seconds, 3)
    scores = {name: lay.score for name, lay in layouts.items()}
    randoms = [sc["J"] for name, sc in scores.items() if name.startswith("random-")]
    best = scores["optimised"]
    rec.update(layouts=len(layouts), J_optimised=round(best["J"], 4), J_contiguous=round(scores["contiguous"]["J"], 4),
               J_random_mean=round(statistics.fmean(randoms), 4) if randoms else None,
               upper_bound=round(best["upper_bound"], 4), J_over_bound=round(best["J"] / best["upper_bound"], 4),
               random_expectation=round(best["random_expectation"], 4))
    if best["J"] < max(sc["J"] for sc in scores.values()) - 1e-9:
        raise RuntimeError("the optimised layout scores below another layout")
    return layouts


def stage_export(check: Check, model: Any, layouts: dict[str, Any], rec: dict[str, Any]) -> None:
    from safetensors.torch import load_file

    from models.export.files import checkpoint_state, read_manifest
    from models.export.resident import permuted_copy
    from models.families.plan import rank_slice
    from models.run import pipeline

    work = Path(tempfile.mkdtemp(prefix="dtp-gpu-check-export-"))
    try:
        state = pipeline.RunState(out_dir=work)
        state.layouts = layouts
        seconds, _ = check.timed(lambda: pipeline.stage_export(state, model=model, tokenizer=None, overwrite=True))
        rec["seconds"] = round(seconds, 3)
        rec["bytes_written"] = sum(p.stat().st_size for p in work.rglob("*") if p.is_file())
        rec["shards"] = len(list((work / "shards").glob("*.safetensors")))

        def verify() -> int:
            """Every shard tensor equals its slice of the permuted weights (read back from disk)."""
            manifest = read_manifest(work / "shards")
            permuted = permuted_copy(model, layouts["optimised"])
            want = {k: v.detach().cpu() for k, v in checkpoint_state(permuted).items()}
            compared = 0
            for entry in manifest["files"]:
                tensors = load_file(str(work / "shards" / entry["name"]))
                for name, tensor in tensors.items():
                    expected = rank_slice(want[name], manifest["split"][name], entry["rank"], manifest["devices"])
                    if not torch.equal(tensor, expected):
                        raise RuntimeError(f"rank {entry['rank']}: {name} differs from the permuted weights")
                    compared += 1
            return compared

        rec["verify_s"], rec["tensors_verified"] = check.timed(verify)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def stage_forward(check: Check, model: Any, rec: dict[str, Any]) -> None:
    s = check.sizes
    ids = random_blocks(s.forward_batch, s.forward_seq, model.config.vocab_size, seed=2).to(check.device)
    t = dtp_vs_dense_times(model, ids, devices=s.devices, delta=s.delta, repeats=s.forward_repeats, sync=check.sync)
    rec.update({f"{k}_ms": round(v * 1e3, 3) for k, v in t.items()})
    rec["tokens"] = int(ids.numel())
    rec["ratio"] = round(t["dtp"] / t["dense"], 3)
    rec["ratio_layers"] = round(t["dtp_layers"] / t["dense_layers"], 3)


def stage_distill(check: Check, model: Any, layouts: dict[str, Any] | None, rec: dict[str, Any]) -> None:
    from models import distill as D
    from models.families import model_shape
    from models.layouts import layout as lay

    s = check.sizes
    recipe = D.DistillRecipe(**s.recipe)
    if layouts is not None:
        layout = layouts["optimised"]
    else:  # the optimiser did not run: the step costs the same under any layout
        layout = lay.contiguous(model_shape(model.config), s.devices, s.delta)
    rec.update(layout=layout.name, recipe=recipe.as_dict(), tokens_per_step=recipe.batch_size * s.seq_len)
    rec["setup_s"], student = check.timed(lambda: D.make_student(model, layout, recipe))  # fp32 permuted copy
    optimizer = D.make_optimizer(student, recipe)
    vocab = model.config.vocab_size
    train = random_blocks(s.distill_steps * recipe.batch_size, s.seq_len, vocab, seed=3)  # [steps·B, S]
    times: list[float] = []
    stats: list[dict[str, float]] = []
    eval_guess = 0.0
    for step in range(s.distill_steps):
        per_step = statistics.median(times[1:] or times) if times else 0.0
        if times and check.remaining() - check.tests_reserve_s < 2 * per_step + eval_guess:
            rec["stopped_early"] = f"time budget: stopped after {step} of {s.distill_steps} steps"
            break
        batch = train[step * recipe.batch_size : (step + 1) * recipe.batch_size].to(check.device)
        seconds, st = check.timed(functools.partial(D.train_step, student, model, batch, optimizer, step=step,
                                                    recipe=recipe))
        times.append(seconds)
        stats.append({k: round(float(v), 5) for k, v in st.as_dict().items() if k != "step"})
        eval_guess = 2 * per_step  # an evaluation of 16 sequences is about a step's forward passes
        if not all(math.isfinite(v) for v in stats[-1].values()):
            raise RuntimeError(f"step {step}: non-finite loss or gradient norm {stats[-1]}")
    rec["steps_done"] = len(times)
    rec["first_step_s"] = round(times[0], 3)
    rec["step_s"] = round(statistics.median(times[1:] or times), 3)
    rec["steps"] = stats
    rec["peak_gib_training"] = check.peak_gib()

    eval_blocks = random_blocks(s.eval_sequences, s.seq_len, vocab, seed=4)
    rec["reference_s"], reference = check.timed(lambda: D.DenseReference.compute(model, eval_blocks, recipe=recipe))
    rec["eval_s"], (kl, ppl) = check.timed(lambda: D.evaluate_student(student, model, reference, recipe=recipe))
    rec.update(eval_tokens=int(eval_blocks.numel()), eval_kl=round(kl, 6), eval_ppl=round(ppl, 3),
               dense_ppl=round(reference.dense_ppl, 3))
    evaluations = 1000 // 100 + 1  # steps 0, 100, …, 1000
    rec["projected_1000_steps_s"] = round(1000 * rec["step_s"] + evaluations * rec["eval_s"] + rec["reference_s"], 1)


def stage_tests(check: Check, rec: dict[str, Any]) -> None:
    """`pytest -m gpu tests/gpu` in a subprocess, with what is left of the budget."""
    timeout = check.remaining() - 25  # pytest gets 20 s to tear down after an interrupt, inside the budget
    if timeout < 20:
        raise SkipStage(f"time budget: {max(0.0, timeout):.0f} s left for the tests")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    if check.device.type != "cuda":
        env["DTP_LAYOUT_GPU_TEST_DEVICE"] = "cpu"  # no GPU: the CPU stands in, to prove the test code itself
        rec["note"] = "no CUDA here: the gpu tests ran with the CPU standing in for the accelerator"
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "tests/gpu", "-q", "-rA", "-p", "no:cacheprovider",
           f"--junitxml={check.out / TESTS_XML}"]
    rec["command"] = " ".join(cmd[2:])
    with open(check.out / TESTS_LOG, "wb") as log_file:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log_file, stderr=subprocess.STDOUT)
        check.child = proc
        try:
            rec["exit_code"] = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            # SIGINT first: pytest then tears its fixtures down (the worker subprocesses with them).
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            rec["exit_code"] = proc.returncode
            rec["timed_out_after_s"] = round(timeout, 1)
        finally:
            check.child = None
    rec.update(junit_counts(check.out / TESTS_XML))
    rec["log"] = TESTS_LOG
    if rec.get("timed_out_after_s") is not None or rec["exit_code"] != 0 or rec.get("failed") or rec.get("errors"):
        rec["status"] = "failed"


# ---- main --------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="directory for gpu_check.json, gpu_check.md and the tests' log")
    ap.add_argument("--tiny", action="store_true", help="tiny sizes (seconds on a CPU): the same code path")
    ap.add_argument("--device", default="auto", help="auto (CUDA when available), cuda, cuda:N or cpu")
    ap.add_argument("--budget-s", type=float, default=380.0, help="seconds for the whole run (default 380)")
    ap.add_argument("--grace-s", type=float, default=20.0, help="past budget + grace the watchdog stops the run")
    ap.add_argument("--skip-tests", action="store_true", help="do not run the gpu tests")
    ap.add_argument("--world-size", type=int, metavar="W",
                    help="ranks of the sharded-distillation stage (default: every visible GPU; it runs only with "
                         "2 or more; on the CPU, W gloo ranks)")
    ap.add_argument("--hang-in", help=argparse.SUPPRESS)  # tests: hang in this stage (the watchdog's test)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sizes = TINY if args.tiny else FULL
    out = Path(args.out)
    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
    command = " ".join(["bench/gpu_check.py", *map(shlex.quote, sys.argv[1:] if argv is None else argv)])
    check = Check(out=out, sizes=sizes, device=device, budget_s=args.budget_s, grace_s=args.grace_s, command=command,
                  tests=not args.skip_tests)
    check.results["environment"] = environment(check)
    if device.type == "cuda" and not torch.cuda.is_available():
        check.results["error"] = f"device {device} asked for, but CUDA is not available (torch {torch.__version__})"
        check.write(status="no CUDA")
        log(check.results["error"])
        return EXIT_NO_CUDA
    if device.type != "cuda" and not args.tiny:
        check.results["error"] = (f"the full-size check needs a CUDA GPU; this torch ({torch.__version__}, CUDA build "
                                  f"{torch.version.cuda}) sees none. --tiny runs the same code path on the CPU")
        check.write(status="no CUDA")
        log(check.results["error"])
        return EXIT_NO_CUDA
    watchdog = check.start_watchdog()
    previous = signal.signal(signal.SIGTERM, check.on_signal)
    try:
        return run_check(check, args)
    finally:
        watchdog.set()
        signal.signal(signal.SIGTERM, previous)


def run_check(check: Check, args: argparse.Namespace) -> int:
    sizes, device, out = check.sizes, check.device, check.out
    check.write()
    log(f"{sizes.name} check on {check.results['environment'].get('gpu', device)}; results in {out}")

    def hang_if_asked(stage: str) -> None:
        if args.hang_in == stage:
            log(f"{stage}: hanging on purpose (--hang-in)")
            while True:
                time.sleep(1)

    def build(rec: dict[str, Any]) -> Any:
        hang_if_asked("model")
        rec["seconds"], model = check.timed(lambda: qwen3_06b_shaped(sizes.layers, dtype=torch.bfloat16,
                                                                      device=device, **sizes.model))
        rec.update(dtype="bfloat16", parameters=sum(p.numel() for p in model.parameters()), layers=sizes.layers,
                   dims={k: getattr(model.config, k) for k in ("vocab_size", "hidden_size", "intermediate_size",
                                                               "num_attention_heads", "num_key_value_heads",
                                                               "head_dim")})
        return model

    def step(name: str, body: Callable[[dict[str, Any]], Any]) -> Callable[[dict[str, Any]], Any]:
        def run(rec: dict[str, Any]) -> Any:
            hang_if_asked(name)
            return body(rec)
        return run

    model = check.run_stage("model", build, needs=2)
    affinity = check.run_stage("affinity", step("affinity", lambda rec: stage_affinity(check, model, rec)),
                               needs=20, after=("model",))
    layouts = check.run_stage("optimise", step("optimise", lambda rec: stage_optimise(check, affinity, rec)),
                              needs=10, after=("affinity",))
    check.run_stage("export", step("export", lambda rec: stage_export(check, model, layouts, rec)),
                    needs=20, after=("model", "optimise"))
    check.run_stage("forward", step("forward", lambda rec: stage_forward(check, model, rec)),
                    needs=10, after=("model",))
    check.run_stage("distill", step("distill", lambda rec: stage_distill(check, model, layouts, rec)),
                    needs=30, after=("model",))
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    world_size, not_applicable = sharded_world_size(device, args.world_size, gpus)
    if not_applicable is None:
        check.run_stage("distill-sharded",
                        step("distill-sharded", lambda rec: stage_distill_sharded(check, model, world_size, rec)),
                        needs=60, after=("model",))
    else:
        check.not_applicable("distill-sharded", not_applicable)
    model = affinity = layouts = None  # the GPU memory goes to vLLM's and the tests' processes
    if device.type == "cuda":
        torch.cuda.empty_cache()
    not_applicable = exchange_not_applicable(device)
    if not_applicable is None:
        check.run_stage("exchange-graph", step("exchange-graph", lambda rec: stage_exchange_graph(check, rec)),
                        needs=30)
    else:
        check.not_applicable("exchange-graph", not_applicable)
    python, not_applicable = serving_applicable(gpus)
    if not_applicable is None:
        assert python is not None
        check.run_stage("serve-vllm", step("serve-vllm", lambda rec: stage_serve_vllm(check, python, rec)), needs=120)
    else:
        check.not_applicable("serve-vllm", not_applicable)
    if not args.skip_tests:
        check.run_stage("tests", step("tests", lambda rec: stage_tests(check, rec)))
    status, code = check.final_status()
    check.write(status=status)
    print(markdown(check.results))
    log(f"{status}; {out / JSON_FILE}, {out / MD_FILE}")
    return code


if __name__ == "__main__":
    sys.exit(main())

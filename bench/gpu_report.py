"""The GPU check's report: its results (bench/gpu_check.py's JSON) as a markdown table next to the
paper's figures, and the gpu tests' counts from their JUnit XML. No torch here: the table can be rebuilt
from a gpu_check.json anywhere,

    python bench/gpu_report.py DIR/gpu_check.json > gpu_check.md
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path
from typing import Any

GIB = 1 << 30
# The paper's figures (§3, "Cost"): one RTX 5090, Qwen3-0.6B, 65,536 calibration tokens; a 1000-step run
# with an evaluation on 16 × 1024 tokens every 100 steps. (lo, hi) in seconds.
PAPER = {
    "affinity_s": (51.0, 51.0),
    "optimise_s": (38.0, 47.0),
    "run_1000_steps_s": (22 * 60.0, 32 * 60.0),
}
PAPER_TEXT = {"affinity_s": "51 s", "optimise_s": "38–47 s", "run_1000_steps_s": "22–32 min"}
PAPER_GPU = "1× RTX 5090"


def _range(lo: float, hi: float, fmt: Callable[[float], str]) -> str:
    return fmt(lo) if lo == hi else f"{fmt(lo)}–{fmt(hi)}"


def _vs_paper(value: float | None, key: str) -> str:
    if value is None:
        return "—"
    lo, hi = PAPER[key]
    return _range(value / hi, value / lo, lambda x: f"{x:.3g}")


def _secs(x: float) -> str:
    return f"{x:.1f} s" if x < 120 else f"{x / 60:.1f} min"


def markdown(results: dict[str, Any]) -> str:
    stages = results["stages"]
    env = results.get("environment", {})
    sizes = results["sizes"]

    def get(stage: str, key: str) -> Any:
        rec = stages.get(stage, {})
        return rec.get(key) if rec.get("status") == "ok" else None

    def state(stage: str) -> str:
        rec = stages.get(stage)
        if rec is None:
            return "not run"
        if rec["status"] == "ok":
            return ""
        return f"**{rec['status']}**: {rec.get('error') or rec.get('reason') or ''}".strip()

    def measured(stage: str, value: Any, fmt: Callable[[Any], str]) -> str:
        return fmt(value) if value is not None else state(stage) or "—"

    paper = PAPER_TEXT
    step_lo, step_hi = (v / 1000 for v in PAPER["run_1000_steps_s"])
    tokens = f"{sizes['calib_sequences']}×{sizes['calib_seq_len']}"
    rows = [
        ("affinity pass, " + tokens + " tokens", measured("affinity", get("affinity", "seconds"), _secs),
         paper["affinity_s"], _vs_paper(get("affinity", "seconds"), "affinity_s"),
         f"÷ dense forward on the same tokens: {get('affinity', 'ratio_to_forward')} (target ≤ 2.5)"
         if get("affinity", "ratio_to_forward") is not None else ""),
        (f"optimiser, L={sizes['devices']}, {sizes['random_layouts']} random layouts scored",
         measured("optimise", get("optimise", "seconds"), _secs), paper["optimise_s"],
         _vs_paper(get("optimise", "seconds"), "optimise_s"),
         f"J/bound {get('optimise', 'J_over_bound')}, J optimised {get('optimise', 'J_optimised')} vs contiguous "
         f"{get('optimise', 'J_contiguous')}" if get("optimise", "seconds") is not None else ""),
        ("export: checkpoint + rank shards", measured("export", get("export", "seconds"), _secs), "—", "—",
         f"{(get('export', 'bytes_written') or 0) / GIB:.2f} GiB written; {get('export', 'tensors_verified')} shard "
         "tensors read back equal" if get("export", "seconds") is not None else ""),
        (f"DTP / dense forward, {sizes['forward_batch']}×{sizes['forward_seq']} tokens",
         measured("forward", get("forward", "ratio"), lambda r: f"{r:.3f}"), "—", "—",
         f"layers only {get('forward', 'ratio_layers')}; target ≤ 1.3" if get("forward", "ratio") else ""),
        (f"distillation step, {sizes['recipe'].get('batch_size', 16)}×{sizes['seq_len']} tokens",
         measured("distill", get("distill", "step_s"), lambda x: f"{x:.3f} s"),
         f"{step_lo:.2f}–{step_hi:.2f} s (run ÷ 1000)",
         _range(get("distill", "step_s") / step_hi, get("distill", "step_s") / step_lo, lambda x: f"{x:.3g}")
         if get("distill", "step_s") is not None else "—",
         ("step 2" if get("distill", "steps_done") == 2 else f"median of steps 2–{get('distill', 'steps_done')}")
         + f" (the first: {get('distill', 'first_step_s')} s)"
         + (f"; peak {get('distill', 'peak_gib_training')} GiB" if get("distill", "peak_gib_training") else "")
         if get("distill", "step_s") is not None else ""),
        ("1000-step run, projected", measured("distill", get("distill", "projected_1000_steps_s"), _secs),
         paper["run_1000_steps_s"], _vs_paper(get("distill", "projected_1000_steps_s"), "run_1000_steps_s"),
         f"1000 × step + 11 evaluations of {sizes['eval_sequences']}×{sizes['seq_len']} tokens "
         f"({get('distill', 'eval_s'):.2f} s each)" if get("distill", "eval_s") is not None else ""),
    ]
    not_applicable = results.get("not_applicable") or {}
    rows.append(_exchange_row(stages.get("exchange-graph"), not_applicable.get("exchange-graph"), state))
    served = stages.get("serve-vllm", {})
    rows.append(("vLLM at TP=2 on the exported shards (tiny fp32 llama, dtp:1)",
                 measured("serve-vllm", get("serve-vllm", "start_s"), lambda x: f"engine ready in {_secs(x)}")
                 if "serve-vllm" not in not_applicable else "not applicable", "—", "—",
                 not_applicable.get("serve-vllm") or (
                     f"greedy tokens equal to `dtp-layout generate`'s ({served.get('prompts')} prompts × "
                     f"{served.get('new_tokens')} tokens); vLLM {served.get('vllm')}" if get("serve-vllm", "start_s")
                     is not None else "")))
    tests = stages.get("tests", {})
    if "passed" in tests:
        test_cell = f"{tests['passed']} passed, {tests['failed']} failed, {tests['errors']} errors, " \
                    f"{tests['skipped']} skipped"
    else:
        test_cell = state("tests") or "not run"
    rows.append(("`gpu` tests", test_cell, "—", "—", "; ".join(tests.get("not_passed", [])) or tests.get("note", "")))

    device = env.get("gpu") or env.get("device", "?")
    lines = [
        f"# GPU check ({results['mode']}): {results['status']}",
        "",
        f"- device: {device}" + (f", {env.get('gpu_memory_gib')} GiB, compute capability {env.get('capability')}"
                                 if env.get("gpu") else ""),
        f"- torch {env.get('torch')} (CUDA {env.get('torch_cuda')}), transformers {env.get('transformers')}, "
        f"Python {env.get('python')}",
        f"- started {results['started']}, {results['elapsed_s']} s of a {results['budget_s']:.0f} s budget",
        f"- command: `{results['command']}`",
        f"- model: Qwen3-0.6B-shaped, {sizes['layers']} layers, random weights, "
        + ("bf16" if results["mode"] == "full" else "bf16 (tiny dimensions)"),
        "",
        f"| stage | measured | paper ({PAPER_GPU}) | here / paper | note |",
        "| --- | --- | --- | --- | --- |",
        *(f"| {' | '.join(str(c) for c in row)} |" for row in rows),
        "",
        "The paper's figures are for Qwen3-0.6B on one RTX 5090 (§3 'Cost'; the 1000-step runs took 22 and "
        "32 min for its two models); 'here / paper' below 1 means faster here. The projected run is 1000 "
        "measured steps plus 11 evaluations, without checkpoint writes.",
    ]
    if not_applicable:
        lines += ["", "Not applicable here: " + "; ".join(f"{k} ({v})" for k, v in not_applicable.items()) + "."]
    if results.get("error"):
        lines += ["", f"**{results['error']}**"]
    if results.get("timed_out_in") or results.get("interrupted_in"):
        lines += ["", f"Stopped in stage {results.get('timed_out_in') or results.get('interrupted_in')}."]
    return "\n".join(lines) + "\n"


def _exchange_row(rec: dict[str, Any] | None, not_applicable: str | None,
                  state: Callable[[str], str]) -> tuple[str, str, str, str, str]:
    """The exchange ops captured in a CUDA graph: replayed = eager, and one call's time each way."""
    what = "exchange ops in a CUDA graph (1 GPU, NCCL), replayed vs eager"
    if not_applicable is not None:
        return what, "not applicable", "—", "—", not_applicable
    if rec is None or rec.get("status") != "ok":
        return what, state("exchange-graph") or "—", "—", "—", ""
    worst = max(rec["graph_of_eager_vs_eager"], rec["graph_of_compiled_vs_eager"], rec["graph_of_eager_into_vs_eager"])
    note = (f"{rec['tokens']}×{rec['hidden']} fp32; one call: eager {rec['eager_call_us']} µs, compiled "
            f"{rec['compiled_call_us']} µs, graph of eager {rec['graph_of_eager_replay_us']} µs, graph of "
            f"compiled {rec['graph_of_compiled_replay_us']} µs, graph of eager with wait_into "
            f"{rec['graph_of_eager_into_replay_us']} µs; eager = blocking all-reduce to "
            f"{rec['eager_vs_reference']:.2g}, compiled = eager to {rec['compiled_vs_eager']:.2g}")
    return what, f"equal (max diff {worst:.2g})", "—", "—", note


def junit_counts(path: Path) -> dict[str, Any]:
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as exc:
        return {"junit": f"unreadable: {exc}"}
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None:
        return {"junit": "no testsuite element"}
    total, failed, errors, skipped = (int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
    not_passed = []
    for case in suite.iter("testcase"):
        for kind in ("failure", "error"):
            if case.find(kind) is not None:
                not_passed.append(f"{case.get('classname')}::{case.get('name')} ({kind})")
    return {"passed": total - failed - errors - skipped, "failed": failed, "errors": errors, "skipped": skipped,
            "not_passed": not_passed}


if __name__ == "__main__":
    print(markdown(json.loads(Path(sys.argv[1]).read_text())), end="")

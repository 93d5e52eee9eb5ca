"""The paper's layout comparison (§5.1) at a size one machine can run, written to docs/.

Optimise the layout of a model (affinity pass on calibration text + optimiser), then distil the DTP
model from the dense one under the optimised layout, the contiguous layout and K random layouts
with one recipe, and report KL/perplexity per evaluation, the step at which the optimised run
reaches the contiguous run's final KL, and the compute multiplier per evaluation.

CPU default (SmolLM2-135M from the packaged GGUF, L=3, δ=1, 200 steps of 4 × 64 tokens, evaluation
on 16 × 64 tokens of Shakespeare, about 35 minutes on 2 cores):

    .venv/bin/python bench/layout_study.py

The paper's scale on a GPU (Qwen3-0.6B, L=4, 1000 steps of 16 × 1024 tokens, WikiText-2 test):

    .venv/bin/python bench/layout_study.py --model Qwen/Qwen3-0.6B --devices 4 --train hf:NAME \\
        --eval hf:Salesforce/wikitext:wikitext-2-raw-v1:test --seq-len 1024 --batch-size 16 \\
        --micro-batch-size 4 --steps 1000 --lr 5e-5 --min-lr 5e-6 --warmup 100 --eval-every 100 \\
        --random 8 --seeds 0,1,2 --calib-sequences 64 --calib-seq-len 1024 --device cuda

Outputs: docs/study.md (table, headline, command), docs/study_curves.png, docs/study_metrics.csv;
the working directory (--work) keeps the layouts, per-run logs and checkpoints, so an interrupted
study resumes where it stopped.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from models import distill, pipeline
from models.calibration import CalibrationSpec
from models.loading import ModelSource, load_model, load_tokenizer

REPO = Path(__file__).resolve().parent.parent
NOTES_MARKER = "## Reading"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the packaged SmolLM2-135M GGUF")
    ap.add_argument("--devices", type=int, default=3)
    ap.add_argument("--delta", type=int, default=1)
    ap.add_argument("--calib", default="corpus:kjv")
    ap.add_argument("--calib-sequences", type=int, default=16)
    ap.add_argument("--calib-seq-len", type=int, default=256)
    ap.add_argument("--random", type=int, default=2, help="random layouts (seeds 1000, 1001, …)")
    ap.add_argument("--train", default="corpus:kjv", help="training data spec")
    ap.add_argument("--eval", default="corpus:shakespeare", help="evaluation data spec")
    ap.add_argument("--eval-blocks", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=64, help="tokens per training and evaluation block")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--min-lr", type=float, default=1e-5)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--seeds", default="0", help="comma-separated training seeds")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--work", default=str(REPO / "var" / "study"), help="layouts, run logs, checkpoints")
    ap.add_argument("--docs", default=str(REPO / "docs"), help="where study.md and the plot go")
    ap.add_argument("--name", default="study", help="output stem: docs/<name>.md, <name>_curves.png, …")
    return ap.parse_args(argv)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def optimise_layouts(args: argparse.Namespace, model: Any, tokenizer: Any, work: Path) -> dict[str, Any]:
    """The `optimise` command's stages without export; skipped when the layouts already exist."""
    report_path = work / pipeline.REPORT_FILE
    if report_path.exists():
        import json

        log(f"layouts exist in {work}, skipping the optimiser")
        report: dict[str, Any] = json.loads(report_path.read_text())
        return report
    calibration = CalibrationSpec(source=args.calib, sequences=args.calib_sequences, seq_len=args.calib_seq_len)
    spec = pipeline.OptimiseSpec(devices=args.devices, delta=args.delta, random_layouts=args.random, export=False)
    state = pipeline.RunState(out_dir=work)
    pipeline.stage_calibration(state, model=model, tokenizer=tokenizer, calibration=calibration)
    pipeline.stage_affinity(state, model=model, spec=spec, model_name=args.model_name, calibration=calibration)
    pipeline.stage_layouts(state, spec=spec)
    report = pipeline.build_report(state, spec=spec, model_name=args.model_name, calibration=calibration)
    pipeline.write_report(state, report)
    log("layouts:\n" + pipeline.summary_table(report))
    return report


def distill_spec(args: argparse.Namespace) -> distill.DistillSpec:
    recipe = distill.DistillRecipe(
        steps=args.steps, batch_size=args.batch_size, micro_batch_size=args.micro_batch_size, lr=args.lr,
        min_lr=args.min_lr, warmup_steps=args.warmup, eval_every=args.eval_every, checkpoint_every=2,
        eval_batch_size=4)
    # Held out by content (models.heldout): training starts after the calibration blocks where it reads
    # the same text, evaluation after both.
    train = CalibrationSpec(source=args.train, sequences=args.steps * args.batch_size, seq_len=args.seq_len)
    evaluation = CalibrationSpec(source=args.eval, sequences=args.eval_blocks, seq_len=args.seq_len)
    calibration = CalibrationSpec(source=args.calib, sequences=args.calib_sequences, seq_len=args.calib_seq_len)
    layouts = ("optimised", "contiguous", *(f"random-{pipeline.RANDOM_SEED_BASE + k}" for k in range(args.random)))
    seeds = tuple(int(s) for s in args.seeds.split(",") if s.strip())
    return distill.DistillSpec(layouts=layouts, train=train, eval=evaluation, devices=args.devices, delta=args.delta,
                               seeds=seeds, recipe=recipe, calibration=calibration)


def markdown_table(summary: dict[str, Any]) -> str:
    layouts = summary["layouts"]
    steps = next(iter(layouts.values()))["steps"]
    head = "| layout | J | " + " | ".join(f"KL@{s}" for s in steps) + " |"
    rule = "|" + " --- |" * (len(steps) + 2)
    rows = [head, rule]
    for name, c in layouts.items():
        j = f"{c['J']:.2f}" if c.get("J") is not None else "–"
        rows.append(f"| {name} | {j} | " + " | ".join(f"{k:.4f}" for k in c["kl"]) + " |")
    rows += ["", "| layout | " + " | ".join(f"ppl@{s}" for s in steps) + " |", "|" + " --- |" * (len(steps) + 1)]
    for name, c in layouts.items():
        rows.append(f"| {name} | " + " | ".join(f"{p:.2f}" for p in c["ppl"]) + " |")
    return "\n".join(rows)


def headline_text(summary: dict[str, Any]) -> str:
    head = summary.get("headline")
    if not head:
        return "No headline (the study needs both the optimised and the contiguous layout)."
    reach = head["candidate_step_to_reference_final_kl"]
    ref_final, cand_final = head["reference_final_kl"], head["candidate_final_kl"]
    lines = [
        f"- final KL: optimised {cand_final:.4f}, contiguous {ref_final:.4f} (optimised "
        f"{abs(ref_final - cand_final) / ref_final:.1%} {'below' if cand_final <= ref_final else 'above'} contiguous).",
        f"- step at which the optimised run reaches the contiguous run's final KL "
        f"(step {head['reference_final_step']}): " + (f"**{reach:.0f}**" if reach is not None else "**not reached**"),
        "",
        "| contiguous step s | contiguous KL | optimised step reaching it | multiplier |",
        "| --- | --- | --- | --- |",
    ]
    for r in head["multipliers"]:
        reached = r["candidate_step"]
        step = "not reached" if reached is None else "0 (below it from the start)" if reached == 0 else f"{reached:.1f}"
        mult = f"{r['multiplier']:.2f}×" if r["multiplier"] is not None else "∞" if reached == 0 else "–"
        lines.append(f"| {r['step']} | {r['reference_kl']:.4f} | {step} | {mult} |")
    return "\n".join(lines)


def run_minutes(work: Path, summary: dict[str, Any]) -> str:
    """Wall minutes of each run, from its own log (so regenerating the docs does not reset them)."""
    import json

    parts = []
    for name in summary["layouts"]:
        for seed in summary["seeds"]:
            path = distill.run_dir_for(work / "distill", name, seed) / "metrics.json"
            records = json.loads(path.read_text())["records"] if path.exists() else []
            if records:
                parts.append(f"{name} {records[-1]['elapsed_s'] / 60:.1f}")
    return ", ".join(parts)


def write_docs(args: argparse.Namespace, summary: dict[str, Any], report: dict[str, Any], docs: Path,
               command: str, work: Path) -> Path:
    stem = args.name
    distill.plot_curves(summary, docs / f"{stem}_curves.png")
    rows = list(distill.iter_records(summary))
    import csv

    with open(docs / f"{stem}_metrics.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["layout", "seed", "step", "kl", "ppl"], lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    recipe = summary["recipe"]
    seeds = ", ".join(map(str, summary["seeds"]))
    text = f"""# Layout study: {summary['model']}, L={summary['devices']}, δ={summary['delta']}

Generated by `bench/layout_study.py` ({torch.get_num_threads()} CPU threads, torch {torch.__version__}; affinity
pass and optimiser {report['seconds'].get('affinity', 0) + report['seconds'].get('optimise', 0):.0f} s, distillation
runs in minutes of wall time: {run_minutes(work, summary)}):

```sh
{command}
```

Setup: layouts from one affinity pass on {report['tokens']} calibration tokens of `{report['calibration']['source']}`
(`optimised`, `contiguous`, and random layouts with seeds 1000…); every layout distilled with the same recipe
({recipe['steps']} steps of {recipe['batch_size']} × {summary['train']['seq_len']} tokens of
`{summary['train']['source']}`, lr {recipe['lr']:g} with {recipe['warmup_steps']} warm-up steps and cosine decay to
{recipe['min_lr']:g}, AdamW β={tuple(recipe['betas'])}, clipping {recipe['grad_clip']:g},
loss KL + {recipe['ce_weight']:g}·CE, embeddings frozen, fp32), training seed(s) {seeds}; evaluation every
{recipe['eval_every']} steps on {summary['eval']['sequences']} × {summary['eval']['seq_len']} tokens of
`{summary['eval']['source']}`: KL(dense ‖ DTP) in nats per token and DTP perplexity (dense perplexity
{summary['dense_ppl']:.3f}). J is the layout's co-located affinity score (random expectation
{report['random_expectation']:.2f}, upper bound {report['upper_bound']:.2f}).

Plot: `docs/{stem}_curves.png`; every evaluation: `docs/{stem}_metrics.csv`.

![KL and perplexity against step]({stem}_curves.png)

## KL and perplexity per evaluation

{markdown_table(summary)}

## Headline figures (optimised vs contiguous)

{headline_text(summary)}
"""
    path = docs / f"{stem}.md"
    # Hand-written reading of the results survives regeneration.
    if path.exists() and NOTES_MARKER in (old := path.read_text()):
        text += "\n" + old[old.index(NOTES_MARKER):]
    path.write_text(text)
    return path


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    command = " ".join([".venv/bin/python bench/layout_study.py", *(shlex.quote(a) for a in (argv or sys.argv[1:]))])
    if args.model is None:
        from models.assets import smollm2_gguf

        args.model = str(smollm2_gguf())
        args.model_name = "SmolLM2-135M-Instruct (packaged GGUF)"
    else:
        args.model_name = args.model
    work, docs = Path(args.work), Path(args.docs)
    work.mkdir(parents=True, exist_ok=True)
    docs.mkdir(parents=True, exist_ok=True)
    source = ModelSource(args.model)
    model, tokenizer = load_model(source, device=args.device), load_tokenizer(source)
    log(f"loaded {args.model_name}; {torch.get_num_threads()} threads")
    report = optimise_layouts(args, model, tokenizer, work)
    spec = distill_spec(args)

    def on_eval(r: distill.EvalRecord) -> None:
        loss = f"{r.loss:.4f}" if r.loss is not None else "-"
        log(f"{r.layout:<12} seed {r.seed} step {r.step:>5}  KL {r.kl:.4f}  ppl {r.ppl:8.2f}  loss {loss}  "
            f"({r.elapsed_s:.0f}s)")

    summary = distill.run_distill(spec, teacher=model, tokenizer=tokenizer, out_dir=work / "distill",
                                  layouts_dir=work / "layouts", model_id=args.model_name, on_eval=on_eval,
                                  keep_checkpoints=False)
    print(distill.summary_table(summary))
    path = write_docs(args, summary, report, docs, command, work)
    log(f"wrote {path}")


if __name__ == "__main__":
    main()

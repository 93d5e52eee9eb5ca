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
import dataclasses
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import score_kl
from models import distill
from models.data.calibration import CalibrationSpec
from models.io.atomic import atomic_write_json
from models.io.loading import ModelSource, load_model, load_tokenizer
from models.layouts.names import RANDOM_SEED_BASE, random_name
from models.run import pipeline
from models.schedules.grammar import dtp_spec
from models.variants.set import ablation_names

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
    ap.add_argument("--random", type=int, default=2,
                    help=f"random layouts (seeds {RANDOM_SEED_BASE}, {RANDOM_SEED_BASE + 1}, …)")
    ap.add_argument("--ablations", action="store_true",
                    help="also the paper's seven spread layouts (§5.4), and the score-vs-KL correlation (§5.2)")
    ap.add_argument("--restarts", type=int, default=4, help="optimiser restarts (0 = the paper's procedure)")
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
    ap.add_argument("--finished-only", action="store_true",
                    help="train nothing: write the docs from the runs that have finished (a partial study)")
    return ap.parse_args(argv)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def optimise_layouts(args: argparse.Namespace, model: Any, tokenizer: Any, work: Path) -> dict[str, Any]:
    """The `optimise` command's stages without export; skipped when the layouts already exist."""
    report_path = work / pipeline.REPORT_FILE
    if report_path.exists():
        log(f"layouts exist in {work}, skipping the optimiser")
        report: dict[str, Any] = json.loads(report_path.read_text())
        return report
    calibration = CalibrationSpec(source=args.calib, sequences=args.calib_sequences, seq_len=args.calib_seq_len)
    spec = pipeline.OptimiseSpec(devices=args.devices, delta=args.delta, schedule=dtp_spec(args.delta),
                                 random_layouts=args.random, export=False,
                                 ablations=args.ablations, restarts=args.restarts)
    state = pipeline.RunState(out_dir=work)
    pipeline.stage_calibration(state, model=model, tokenizer=tokenizer, calibration=calibration)
    pipeline.stage_affinity(state, model=model, spec=spec, model_name=args.model_name, calibration=calibration)
    pipeline.stage_layouts(state, spec=spec)
    report = pipeline.build_report(state, spec=spec, model_name=args.model_name, calibration=calibration)
    pipeline.write_report(state, report)
    log("layouts:\n" + pipeline.summary_table(report))
    return report


def study_layouts(args: argparse.Namespace) -> tuple[str, ...]:
    """Trained in this order: the ends of the score axis first, so a partial study still spans it."""
    randoms = [random_name(RANDOM_SEED_BASE + k) for k in range(args.random)]
    if not args.ablations:
        return ("optimised", "contiguous", *randoms)
    spread = ablation_names("fo", args.restarts)
    order = ["optimised", "anti-optimised", "contiguous", "neurons-only", "heads-only", "4-layers", *randoms[:1],
             "add-score", "8-layers", "12-layers", *randoms[1:], *spread]
    return tuple(dict.fromkeys(n for n in order if n in spread or n in randoms or n in ("optimised", "contiguous")))


def distinct_layouts(names: tuple[str, ...], work: Path) -> tuple[str, ...]:
    """Drop a layout whose assignment equals an earlier one's (e.g. neurons-only when the optimiser never
    moves a KV group): the same run twice would only count one point twice. Noted in duplicates.json."""
    seen: dict[str, str] = {}
    duplicates: dict[str, str] = {}
    keep = []
    for name in names:
        path = work / "layouts" / f"{name}.json"
        if path.exists():
            doc = json.loads(path.read_text())
            key = json.dumps([doc["kv_group_device"], doc["neuron_device"]])
            if key in seen:
                duplicates[name] = seen[key]
                log(f"{name} is the same layout as {seen[key]}: trained once")
                continue
            seen[key] = name
        keep.append(name)
    atomic_write_json(work / "duplicates.json", duplicates)
    return tuple(keep)


def distill_spec(args: argparse.Namespace) -> distill.DistillSpec:
    recipe = distill.DistillRecipe(
        steps=args.steps, batch_size=args.batch_size, micro_batch_size=args.micro_batch_size, lr=args.lr,
        min_lr=args.min_lr, warmup_steps=args.warmup, eval_every=args.eval_every, checkpoint_every=2,
        eval_batch_size=4)
    # Held out by content (models.data.heldout): training starts after the calibration blocks where it reads
    # the same text, evaluation after both.
    train = CalibrationSpec(source=args.train, sequences=args.steps * args.batch_size, seq_len=args.seq_len)
    evaluation = CalibrationSpec(source=args.eval, sequences=args.eval_blocks, seq_len=args.seq_len)
    calibration = CalibrationSpec(source=args.calib, sequences=args.calib_sequences, seq_len=args.calib_seq_len)
    layouts = study_layouts(args)
    seeds = tuple(int(s) for s in args.seeds.split(",") if s.strip())
    return distill.DistillSpec(layouts=layouts, train=train, eval=evaluation, devices=args.devices, delta=args.delta,
                               schedule=dtp_spec(args.delta), seeds=seeds, recipe=recipe, calibration=calibration)


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


def run_finished(work: Path, layout: str, seed: int) -> bool:
    path = distill.run_dir_for(work / "distill", layout, seed) / "metrics.json"
    return path.exists() and bool(json.loads(path.read_text()).get("complete"))


def score_kl_text(args: argparse.Namespace, summary: dict[str, Any], report: dict[str, Any], docs: Path,
                  work: Path) -> str:
    """The §5.2 section: J at initialisation against the KL after training, with the plot."""
    result = score_kl.analyse(report, score_kl.kl_by_layout(work / "distill" / "metrics.csv"),
                              step=summary["recipe"]["steps"])
    atomic_write_json(work / "score_kl.json", result)
    plot_name = f"{args.name}_score_kl.png"
    score_kl.plot(result, docs / plot_name, title=f"{summary['model']}: L={summary['devices']}, "
                                                  f"δ={summary['delta']}, {len(result['points'])} layouts")
    return f"""
## Score at initialisation vs trained KL (§5.2)

J is each layout's co-located score in FO units at initialisation (the ADD-score layout rescored in FO
units), KL the per-token KL to the dense model on the held-out evaluation blocks. Grey points: random
layouts. Plot: `docs/{plot_name}`; numbers: `score_kl.json` in the study's working directory.

{score_kl.markdown(result, plot_name)}
"""


def run_minutes(work: Path, summary: dict[str, Any]) -> str:
    """Wall minutes of each run, from its own log (so regenerating the docs does not reset them)."""
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
""" + (score_kl_text(args, summary, report, docs, work) if args.ablations else "")
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
        from models.io.assets import smollm2_gguf

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
    spec = dataclasses.replace(spec, layouts=distinct_layouts(spec.layouts, work))
    if args.finished_only:
        finished = tuple(n for n in spec.layouts if all(run_finished(work, n, seed) for seed in spec.seeds))
        if not finished:
            raise SystemExit(f"no finished runs under {work / 'distill'}")
        spec = dataclasses.replace(spec, layouts=finished)

    def on_eval(r: distill.EvalRecord) -> None:
        loss = f"{r.loss:.4f}" if r.loss is not None else "-"
        log(f"{r.layout:<12} seed {r.seed} step {r.step:>5}  KL {r.kl:.4f}  ppl {r.ppl:8.2f}  loss {loss}  "
            f"({r.elapsed_s:.0f}s)")
        if args.ablations and r.step == spec.recipe.steps:
            # Each finished run updates the correlation, so an interrupted study still has its numbers.
            result = score_kl.analyse(report, score_kl.kl_by_layout(work / "distill" / "metrics.csv"),
                                      step=spec.recipe.steps)
            atomic_write_json(work / "score_kl.json", result)
            log(f"score vs KL@{result['step']}: {json.dumps(result['trained'])}")

    summary = distill.run_distill(spec, teacher=model, tokenizer=tokenizer, out_dir=work / "distill",
                                  layouts_dir=work / "layouts", model_id=args.model_name, on_eval=on_eval,
                                  keep_checkpoints=False)
    print(distill.summary_table(summary))
    path = write_docs(args, summary, report, docs, command, work)
    log(f"wrote {path}")


if __name__ == "__main__":
    main()

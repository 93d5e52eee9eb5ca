"""Issue 20's study: every communication schedule on one model, contiguous vs the layout optimised for it.

For each schedule (dtp:1, dtp:2, spd:isolated:K for two K, pt:2, pt:4, ladder, dtp:1@K upper half) on
SmolLM2-135M at L=3 (the packaged GGUF, as bench/layout_study.py): its syncs per token (all, and the
blocking ones), the runtime's blocked time per token (bench/runtime.py's recorded figures in
docs/benchmarks.md, not rerun here), and KL(dense ‖ schedule) at step 0 and after one distillation budget
for the contiguous layout and the layout optimised for that schedule's J_σ (ladder is layout-independent:
one arm). At dtp:2 also the dtp:1-optimised layout, and both optimised layouts with several training seeds
(the paper's protocol: the seed changes the block order).

Affinity passes are shared where the edges allow: the chain's (dtp:1) serves dtp:1, spd:B and dtp:1@K;
pt:4's (a superset of pt:2's edges) serves both pt schedules; spd's per-layer sensitivities are measured
once and give both K.

    .venv/bin/python bench/schedules_study.py            # the CPU study (6 steps per arm; ~45 core-min at load 5-7)
    .venv/bin/python bench/schedules_study.py --quick    # smoke run: tiny budget, var/schedules-quick

Outputs: docs/schedules_study.md (table + command + times; a hand-written `## Reading` section survives
regeneration), docs/schedules_pareto.png, docs/schedules_metrics.csv (every evaluation). The working
directory (--work) keeps affinities, layouts and runs: a rerun skips what exists.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import re
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.layout_study import NOTES_MARKER, log
from models import distill
from models.affinity.file import AffinityResult
from models.data.calibration import CalibrationSpec, load_blocks
from models.evaluation.spd_auto import cumulative_choice, least_sensitive, spd_sensitivities
from models.families import model_shape
from models.io.atomic import atomic_write_json
from models.io.loading import ModelSource, load_model, load_tokenizer
from models.layouts import layout as layout_mod
from models.run import pipeline
from models.run.files import AFFINITY_FILE
from models.schedules.grammar import Schedule, parse_schedule, resolve_schedule
from models.variants.set import build_layouts, scored_layout

REPO = Path(__file__).resolve().parent.parent
CONTIGUOUS, OPTIMISED, DTP1_OPTIMISED = "contiguous", "optimised", "optimised-dtp1"

# bench/runtime.py's two recorded runs (docs/benchmarks.md, "Runtime: blocked time per schedule"): L=2 pinned
# ranks, a SmolLM2-135M-shaped random model, CPU emulation of the link. Per schedule: blocked ms/token at
# 0 µs and its growth at 2 ms, (first run, second run). spd there is spd over the 15 odd layers.
RUNTIME_RUNS = {
    "tp": ((143.5, 125.1), (232.2, 240.1)),
    "dtp:1": ((74.9, 68.9), (68.7, 64.2)),
    "dtp:2": ((82.9, 68.3), (28.2, 25.0)),
    "ladder": ((71.8, 64.2), (83.7, 73.4)),
    "spd:15": ((127.9, 117.3), (165.0, 150.6)),
    "pt:2": ((86.2, 68.8), (128.9, 43.0)),
    "pt:4": ((140.9, 114.6), (43.4, -4.4)),
    "dtp:1@15": ((105.3, 95.9), (163.3, 146.6)),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the packaged SmolLM2-135M GGUF")
    ap.add_argument("--devices", type=int, default=3)
    ap.add_argument("--spd", default="8,15", help="the K of spd:isolated:K (layers whose attention sync is "
                    "dropped; the rule issue 20's study ran — spd:auto:K, the cumulative rule, via --schedules)")
    ap.add_argument("--upper", type=int, default=None, help="dtp:1@K's K (default: half the layers)")
    ap.add_argument("--calib", default="corpus:kjv")
    ap.add_argument("--calib-sequences", type=int, default=4)
    ap.add_argument("--calib-seq-len", type=int, default=128)
    ap.add_argument("--restarts", type=int, default=2, help="optimiser restarts")
    ap.add_argument("--train", default="corpus:kjv")
    ap.add_argument("--eval", default="corpus:shakespeare")
    ap.add_argument("--eval-blocks", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--min-lr", type=float, default=1e-5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--eval-every", type=int, default=6)
    ap.add_argument("--seeds", default="0,1,2", help="training seeds of the dtp:2 comparison's two layouts")
    ap.add_argument("--schedules", default=None, help="a comma-free subset, separated by spaces (default: all)")
    ap.add_argument("--seeds-first", action="store_true",
                    help="train the dtp:2 comparison's further seeds (not seed 0) before the listed schedules' arms")
    ap.add_argument("--contiguous-only", default="",
                    help="schedules (space-separated) whose contiguous arm alone is trained (no affinity pass)")
    ap.add_argument("--optimised-only", default="",
                    help="schedules (space-separated) whose optimised arm alone is trained (the complement of "
                         "another process's --contiguous-only)")
    ap.add_argument("--step0-only", action="store_true",
                    help="train nothing: KL at step 0 of the listed schedules' arms that have no run yet")
    ap.add_argument("--report-only", action="store_true", help="train nothing: write the docs from what exists")
    ap.add_argument("--only-seed-0", action="store_true", help="train seed 0 of every arm only (a partial study)")
    ap.add_argument("--further-seeds-only", action="store_true",
                    help="train only the dtp:2 comparison's seeds other than 0 (another process trains seed 0)")
    ap.add_argument("--dtp2-table", action="store_true",
                    help="train nothing: print the dtp:2 comparison's tables (every arm, per seed) from what exists")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 2 steps, 2 × 32 eval tokens, 2 × 32 calibration tokens, into var/")
    ap.add_argument("--work", default=None, help="default var/schedules (var/schedules-quick with --quick)")
    ap.add_argument("--docs", default=None, help="default docs/ (var/schedules-quick/docs with --quick)")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.eval_every, args.warmup, args.batch_size, args.seq_len = 2, 1, 1, 1, 32
        args.eval_blocks, args.calib_sequences, args.calib_seq_len, args.restarts = 2, 2, 32, 0
        args.seeds = "0,1"
    stem = "schedules-quick" if args.quick else "schedules"
    args.work = args.work or str(REPO / "var" / stem)
    args.docs = args.docs or str(REPO / ("var/schedules-quick/docs" if args.quick else "docs"))
    return args


def slug(schedule: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", schedule).strip("-")


def schedule_names(args: argparse.Namespace, num_layers: int) -> list[str]:
    """The study's schedules, in the table's order (spd:isolated:K as written; resolved later)."""
    upper = args.upper or num_layers // 2
    spd = [f"spd:isolated:{k}" for k in args.spd.split(",") if k.strip()]
    return ["dtp:1", "dtp:2", *spd, "pt:2", "pt:4", "ladder", f"dtp:1@{upper}"]


def affinity_source(schedule: str) -> str | None:
    """Whose affinity pass serves `schedule`'s J_σ: the chain's for the chain's subsets, pt:4's for pt:2."""
    spec = parse_schedule(schedule)
    if spec.kind in ("spd", "spd-auto") or (spec.kind == "dtp" and spec.delta <= 1):
        return "dtp:1"
    if spec.kind == "pt":
        return "pt:4" if spec.block <= 4 else schedule
    if spec.kind in ("tp", "ladder"):
        return None
    return schedule


def blocking_syncs(sched: Schedule) -> int:
    """Exchange points with nothing to hide the exchange behind: some partial arrives at the module right
    after its own (a_n = n+1), so the receiver waits for the whole all-reduce (tp: every one)."""
    return len({a for n, a in enumerate(sched.other_arrival) if a is not None and a == n + 1})


class Study:
    def __init__(self, args: argparse.Namespace, model: Any, tokenizer: Any) -> None:
        self.args, self.model, self.tokenizer = args, model, tokenizer
        self.work = Path(args.work)
        # --report-only loads no model: the shape is any stored layout's
        self.shape = (model_shape(model.config) if model is not None
                      else layout_mod.load(next((self.work / "layouts").glob("*/*.json"))).shape)
        self.calibration = CalibrationSpec(source=args.calib, sequences=args.calib_sequences,
                                           seq_len=args.calib_seq_len)
        self.blocks: torch.Tensor | None = None
        self.seconds: dict[str, float] = self._read_json("seconds.json", {})

    def _read_json(self, name: str, default: Any) -> Any:
        path = self.work / name
        return json.loads(path.read_text()) if path.exists() else default

    def _timed(self, key: str, t0: float, add: bool = False) -> None:
        """Record a wall time; merged into the file another process (another subset) may also write."""
        self.seconds = {**self._read_json("seconds.json", {}), **self.seconds}
        self.seconds[key] = round((self.seconds.get(key, 0.0) if add else 0.0) + time.perf_counter() - t0, 1)
        atomic_write_json(self.work / "seconds.json", self.seconds)

    def calib_blocks(self) -> torch.Tensor:
        if self.blocks is None:
            self.blocks = load_blocks(self.calibration, self.tokenizer, vocab_size=self.model.config.vocab_size)
        return self.blocks

    def resolve(self, schedule: str) -> Schedule:
        return resolve_schedule(schedule, self.shape.num_layers, self.args.devices)

    def sensitivities(self) -> list[float]:
        """SPD's rule, measured once: per layer, KL(dense ‖ spd:i) on the calibration blocks."""
        path = self.work / "spd_sensitivities.json"
        if not path.exists():
            t0 = time.perf_counter()
            sens = spd_sensitivities(self.model, self.calib_blocks(), devices=self.args.devices, batch_size=4)
            atomic_write_json(path, sens)
            self._timed("spd_sensitivities", t0)
            log(f"spd sensitivities: {[round(s, 4) for s in sens]}")
        return list(json.loads(path.read_text()))

    def resolved_name(self, schedule: str) -> str:
        """spd:isolated:K / spd:auto:K → the spd:B its rule picks; every other schedule as is (canonical)."""
        spec = parse_schedule(schedule)
        if spec.kind != "spd-auto":
            return str(spec)
        if spec.rule == "isolated":
            return str(spec.with_spd_layers(least_sensitive(self.sensitivities(), spec.count)))
        path = self.work / f"spd_cumulative_{spec.count}.json"  # K rounds of N - r simulations: kept
        if not path.exists():
            t0 = time.perf_counter()
            chosen, rounds = cumulative_choice(self.model, self.calib_blocks(), spec.count,
                                               devices=self.args.devices, batch_size=4)
            atomic_write_json(path, {"layers": list(chosen), "rounds": [{str(i): kl for i, kl in r.items()}
                                                                        for r in rounds]})
            self._timed(f"spd_cumulative_{spec.count}", t0)
        return str(spec.with_spd_layers(tuple(json.loads(path.read_text())["layers"])))

    def affinity(self, source: str) -> AffinityResult:
        path = self.work / "affinity" / slug(source) / AFFINITY_FILE
        if path.exists():
            return AffinityResult.load(path)
        t0 = time.perf_counter()
        spec = pipeline.OptimiseSpec(devices=self.args.devices, schedule=parse_schedule(source), export=False)
        # J_σ of `source` itself, dtp:1 included (a run's objective takes dtp:1 as the chain)
        sched = resolve_schedule(source, self.shape.num_layers, self.args.devices)
        result = pipeline.run_affinity(self.model, self.calib_blocks(), schedule=sched, spec=spec,
                                       metadata={"model": self.args.model_name,
                                                 "calibration": json.dumps(dataclasses.asdict(self.calibration))})
        path.parent.mkdir(parents=True, exist_ok=True)
        result.save(path)
        self._timed(f"affinity {source}", t0)
        log(f"affinity pass for {source}: {self.seconds[f'affinity {source}']:.0f} s")
        return result

    def layouts(self, schedule: str) -> Path:
        """work/layouts/<schedule>/{optimised,contiguous[,optimised-dtp1]}.json, each scored in J_σ of it."""
        resolved = self.resolved_name(schedule)
        out = self.work / "layouts" / slug(schedule)
        source = affinity_source(schedule)
        if source is None or (out / f"{OPTIMISED}.json").exists():
            return out
        sched = self.resolve(resolved)
        result = self.affinity(source)
        t0 = time.perf_counter()
        built = build_layouts(result, devices=self.args.devices, delta=1, restarts=self.args.restarts,
                              schedule=sched)
        for name in (OPTIMISED, CONTIGUOUS):
            built[name].save(out / f"{name}.json")
        if schedule == "dtp:2":  # the dtp:1 layout, scored in J_σ of dtp:2
            dtp1 = layout_mod.load(self.layouts("dtp:1") / f"{OPTIMISED}.json")
            lay = scored_layout(dtp1.with_name(DTP1_OPTIMISED), result, score_name="fo", objective="fo",
                                restarts=self.args.restarts, schedule=sched)
            lay.save(out / f"{DTP1_OPTIMISED}.json")
        self._timed(f"optimise {schedule}", t0)
        log(f"{schedule} ({resolved}): J_σ optimised {built[OPTIMISED].score['J']:.3f}, "  # type: ignore[index]
            f"contiguous {built[CONTIGUOUS].score['J']:.3f}")  # type: ignore[index]
        return out

    def distill_spec(self, schedule: str, layouts: tuple[str, ...], seeds: tuple[int, ...]) -> distill.DistillSpec:
        a = self.args
        recipe = distill.DistillRecipe(steps=a.steps, batch_size=a.batch_size, micro_batch_size=a.batch_size,
                                       lr=a.lr, min_lr=a.min_lr, warmup_steps=a.warmup, eval_every=a.eval_every,
                                       checkpoint_every=10, eval_batch_size=4)
        train = CalibrationSpec(source=a.train, sequences=a.steps * a.batch_size, seq_len=a.seq_len)
        evaluation = CalibrationSpec(source=a.eval, sequences=a.eval_blocks, seq_len=a.seq_len)
        return distill.DistillSpec(layouts=layouts, train=train, eval=evaluation, devices=a.devices, delta=1,
                                   seeds=seeds, recipe=recipe, calibration=self.calibration,
                                   schedule=parse_schedule(self.resolved_name(schedule)))

    def arms(self, schedule: str) -> tuple[str, ...]:
        if affinity_source(schedule) is None:
            return (CONTIGUOUS,)  # layout-independent: one arm
        return (OPTIMISED, DTP1_OPTIMISED, CONTIGUOUS) if schedule == "dtp:2" else (OPTIMISED, CONTIGUOUS)

    def train(self, schedule: str, layouts: tuple[str, ...], seeds: tuple[int, ...]) -> None:
        spec = self.distill_spec(schedule, layouts, seeds)
        layouts_dir = self.layouts(schedule) if layouts != (CONTIGUOUS,) else None
        out = self.work / "distill" / slug(schedule)
        t0 = time.perf_counter()

        def on_eval(r: distill.EvalRecord) -> None:
            log(f"{schedule:<12} {r.layout:<15} seed {r.seed} step {r.step:>4}  KL {r.kl:.4f}  ppl {r.ppl:9.2f}  "
                f"({r.elapsed_s:.0f}s)")

        distill.run_distill(spec, teacher=self.model, tokenizer=self.tokenizer, out_dir=out,
                            layouts_dir=layouts_dir, model_id=self.args.model_name, on_eval=on_eval,
                            keep_checkpoints=False, plot=False)
        key = f"distill {schedule} {','.join(layouts)} seeds {','.join(map(str, seeds))}"
        self._timed(key, t0, add=True)

    def step0(self, schedule: str, layouts: tuple[str, ...]) -> None:
        """KL at step 0 only, for arms the budget leaves untrained (work/step0/<schedule>/<layout>.json)."""
        from models.distill.comparison.compare import resolve_layouts
        from models.distill.data import load_data, place_data
        from models.distill.evaluation import DenseReference, evaluate_student
        from models.distill.student import make_student

        out = self.work / "step0" / slug(schedule)
        todo = [n for n in layouts if not (out / f"{n}.json").exists()
                and not (distill.run_dir_for(self.work / "distill" / slug(schedule), n, 0) / "metrics.json").exists()]
        if n_missing := [n for n in todo if n != CONTIGUOUS and not (self.layouts(schedule) / f"{n}.json").exists()]:
            log(f"{schedule}: no layout {n_missing}, skipped")
            todo = [n for n in todo if n not in n_missing]
        if not todo:
            return
        spec = self.distill_spec(schedule, tuple(todo), (0,))
        placement = place_data(spec)
        _, eval_blocks = load_data(spec, tokenizer=self.tokenizer, vocab_size=int(self.model.config.vocab_size),
                                   placement=placement)
        reference = DenseReference.compute(self.model, eval_blocks, recipe=spec.recipe)
        resolved = resolve_layouts(spec.layouts, shape=self.shape, devices=self.args.devices, delta=1,
                                   layouts_dir=self.layouts(schedule))
        for name, lay in resolved.items():
            student = make_student(self.model, lay, spec.recipe, spec.schedule)
            kl, ppl = evaluate_student(student, self.model, reference, recipe=spec.recipe)
            record = {"layout": name, "seed": 0, "step": 0, "kl": kl, "ppl": ppl}
            atomic_write_json(out / f"{name}.json", {"records": [record], "complete": False, "step0_only": True})
            log(f"{schedule:<12} {name:<15} step 0 only  KL {kl:.4f}  ppl {ppl:9.2f}")

    def records(self, schedule: str) -> list[dict[str, Any]]:
        """Every evaluation of every finished or partial run of `schedule`, from the runs' own files."""
        rows = []
        runs = self.work / "distill" / slug(schedule) / "runs"
        step0 = sorted((self.work / "step0" / slug(schedule)).glob("*.json"))
        for path in sorted(runs.glob("*/seed-*/metrics.json")) + step0:
            doc = json.loads(path.read_text())
            for r in doc["records"]:
                rows.append({"schedule": schedule, "resolved": self.resolved_name(schedule), "layout": r["layout"],
                             "seed": r["seed"], "step": r["step"], "kl": r["kl"], "ppl": r["ppl"],
                             "complete": bool(doc.get("complete")), "elapsed_s": r.get("elapsed_s")})
        return rows

    def layout_scores(self, schedule: str) -> dict[str, dict[str, Any]]:
        out = self.work / "layouts" / slug(schedule)
        scores = {}
        for name in self.arms(schedule):
            path = out / f"{name}.json"
            if path.exists():
                scores[name] = layout_mod.load(path).score or {}
        return scores


def run(study: Study, schedules: list[str], seeds: tuple[int, ...], only_seed_0: bool) -> None:
    """Seed 0 of every arm (the table's row for every schedule), then the dtp:2 comparison's seeds; with
    --seeds-first those seeds (but seed 0) come first, so that two processes can share the work."""
    further = tuple(s for s in seeds if s != 0)
    if (study.args.seeds_first or study.args.further_seeds_only) and further:
        study.train("dtp:2", (OPTIMISED, DTP1_OPTIMISED), further)
    if study.args.further_seeds_only:
        return
    contiguous_only, optimised_only = study.args.contiguous_only.split(), study.args.optimised_only.split()
    for s in schedules:
        arms = (CONTIGUOUS,) if s in contiguous_only else (OPTIMISED,) if s in optimised_only else study.arms(s)
        study.train(s, arms, (0,))
    if not only_seed_0 and "dtp:2" in schedules and len(seeds) > 1:
        study.train("dtp:2", (OPTIMISED, DTP1_OPTIMISED), seeds)  # finished seed-0 runs are skipped


def final_kls(rows: list[dict[str, Any]], layout: str, steps: int) -> tuple[float | None, list[float]]:
    """(KL at step 0, KL at the last step per finished seed) of one arm."""
    at0 = [r["kl"] for r in rows if r["layout"] == layout and r["step"] == 0 and r["seed"] == 0]
    last = [r["kl"] for r in sorted(rows, key=lambda r: r["seed"]) if r["layout"] == layout and r["step"] == steps]
    return (at0[0] if at0 else None), last


def fmt_kls(kls: list[float]) -> str:
    if not kls:
        return "–"
    if len(kls) == 1:
        return f"{kls[0]:.3f}"
    mean = sum(kls) / len(kls)
    return f"{mean:.3f} ({min(kls):.3f}–{max(kls):.3f}, n={len(kls)})"


def runtime_cell(schedule: str, resolved: str) -> str:
    spec = parse_schedule(resolved)
    key = "spd:15" if spec.kind == "spd" and len(spec.layers) == 15 else resolved
    figs = RUNTIME_RUNS.get(key)
    if figs is None:
        return "not measured"
    (b1, b2), (g1, g2) = figs
    return f"{b1:.0f} / {b2:.0f}; +{g1:.0f} / {g2:+.0f}".replace("+-", "−").replace("++", "+")


def table_rows(study: Study, schedules: list[str]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(per-arm rows for the table and the plot, every evaluation for the CSV)."""
    arms, evaluations = [], []
    for s in schedules:
        resolved = study.resolved_name(s)
        sched = study.resolve(resolved)
        rows = study.records(s)
        evaluations += rows
        scores = study.layout_scores(s)
        for name in study.arms(s):
            at0, last = final_kls(rows, name, study.args.steps)
            score = scores.get(name, {})
            arms.append({"schedule": s, "resolved": resolved, "layout": name, "syncs": sched.syncs_per_token,
                         "blocking": blocking_syncs(sched), "layout_independent": sched.layout_independent,
                         "J": score.get("J"), "bound": score.get("upper_bound"), "kl0": at0, "kl": last,
                         "runtime": runtime_cell(s, resolved)})
    return arms, evaluations


def markdown_table(arms: list[dict[str, Any]], steps: int) -> str:
    head = ("| schedule | syncs / token (blocking) | runtime blocked ms/token @0 µs; +growth @2 ms (run 1 / run 2) "
            f"| layout | J_σ (bound) | KL @0 | KL @{steps} (seeds) |")
    lines = [head, "| --- | --- | --- | --- | --- | --- | --- |"]
    for a in arms:
        name = a["schedule"] + (f" = `{a['resolved']}`" if a["resolved"] != a["schedule"] else "")
        layout = "any (layout-independent)" if a["layout_independent"] else a["layout"]
        j = f"{a['J']:.2f} ({a['bound']:.2f})" if a["J"] is not None and a["bound"] is not None else "–"
        kl0 = f"{a['kl0']:.3f}" if a["kl0"] is not None else "–"
        lines.append(f"| {name} | {a['syncs']} ({a['blocking']}) | {a['runtime']} | {layout} | {j} | {kl0} | "
                     f"{fmt_kls(a['kl'])} |")
    return "\n".join(lines)


def dtp2_seed_table(arms: list[dict[str, Any]], evaluations: list[dict[str, Any]], steps: int) -> str:
    lines = ["| layout at dtp:2 | J_σ(dtp:2) | KL @0 | " + f"KL @{steps} per seed | mean | spread (max − min) |",
             "| --- | --- | --- | --- | --- | --- |"]
    for a in arms:
        if a["schedule"] != "dtp:2" or a["layout"] == CONTIGUOUS:
            continue
        per_seed = {r["seed"]: r["kl"] for r in evaluations
                    if r["schedule"] == "dtp:2" and r["layout"] == a["layout"] and r["step"] == steps}
        kls = list(per_seed.values())
        cells = ", ".join(f"s{seed}: {kl:.4f}" for seed, kl in sorted(per_seed.items())) or "–"
        mean = f"{sum(kls) / len(kls):.4f}" if kls else "–"
        spread = f"{max(kls) - min(kls):.4f}" if len(kls) > 1 else "–"
        j = f"{a['J']:.3f}" if a["J"] is not None else "–"
        kl0 = f"{a['kl0']:.4f}" if a["kl0"] is not None else "–"
        lines.append(f"| {a['layout']} | {j} | {kl0} | {cells} | {mean} | {spread} |")
    return "\n".join(lines)


def _panel(ax: Any, arms: list[dict[str, Any]], values: Any, ylabel: str) -> None:
    """One quality-vs-blocking-syncs panel: each arm's KL (mean over seeds, bar: their range), the Pareto
    front of each schedule's better arm (dashed)."""
    markers = {OPTIMISED: ("*", 150), DTP1_OPTIMISED: ("P", 90), CONTIGUOUS: ("o", 60)}
    best: dict[str, tuple[int, float]] = {}
    for a in arms:
        kls = values(a)
        if not kls:
            continue
        kl = sum(kls) / len(kls)
        marker, size = markers[a["layout"]]
        label = a["layout"] if not a["layout_independent"] else "layout-independent"
        ax.scatter(a["blocking"], kl, marker=marker, s=size, label=label, alpha=0.8,
                   color={OPTIMISED: "C1", DTP1_OPTIMISED: "C2", CONTIGUOUS: "C0"}[a["layout"]])
        if len(kls) > 1:
            ax.vlines(a["blocking"], min(kls), max(kls), color="grey", lw=1)
        if a["schedule"] not in best or kl < best[a["schedule"]][1]:
            best[a["schedule"]] = (a["blocking"], kl)
    for s, (x, y) in best.items():
        ax.annotate(s, (x, y), textcoords="offset points", xytext=(6, 4), fontsize=8)
    front, low = [], float("inf")
    for x, y in sorted(best.values()):
        if y < low:
            front.append((x, y))
            low = y
    ax.step([p[0] for p in front], [p[1] for p in front], where="post", color="k", lw=0.8, ls="--")
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles, strict=True))
    ax.legend(unique.values(), unique.keys(), fontsize=7)
    ax.set_yscale("log")
    ax.set_xlim(-3, 63)
    ax.set_xlabel("blocking syncs per token (tp: 60, KL 0)")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3, which="both")


def plot_pareto(arms: list[dict[str, Any]], path: Path, title: str, steps: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 5), sharey=True)
    _panel(left, arms, lambda a: [a["kl0"]] if a["kl0"] is not None else [], "KL(dense ‖ schedule), nats/token")
    left.set_title("step 0 (no training)", fontsize=9)
    _panel(right, arms, lambda a: a["kl"], "KL(dense ‖ schedule), nats/token")
    right.set_title(f"after {steps} distillation steps", fontsize=9)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(study: Study, schedules: list[str], command: str) -> Path:
    args, docs = study.args, Path(study.args.docs)
    docs.mkdir(parents=True, exist_ok=True)
    arms, evaluations = table_rows(study, schedules)
    with open(docs / "schedules_metrics.csv", "w", newline="") as f:
        cols = ["schedule", "resolved", "layout", "seed", "step", "kl", "ppl"]
        writer = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore", lineterminator="\n")
        writer.writeheader()
        writer.writerows(sorted(evaluations, key=lambda r: (schedules.index(r["schedule"]), r["layout"], r["seed"],
                                                            r["step"])))
    atomic_write_json(Path(args.work) / "arms.json", arms)
    title = (f"{args.model_name}, L={args.devices}: {args.steps} steps of {args.batch_size} × {args.seq_len} "
             f"tokens; bars: seeds' range")
    plot_pareto(arms, docs / "schedules_pareto.png", title, args.steps)
    sens = study._read_json("spd_sensitivities.json", None)
    sens_text = ("" if sens is None else "SPD's per-layer sensitivities (KL(dense ‖ spd:i), nats/token, "
                 "calibration blocks, contiguous layout): " + ", ".join(f"{i}: {s:.4f}" for i, s in enumerate(sens)))
    secs = study.seconds
    times = "; ".join(f"{k} {v / 60:.1f} min" for k, v in secs.items())
    text = f"""# Communication schedules on one model: {args.model_name}, L={args.devices}

Generated by `bench/schedules_study.py` (torch {torch.__version__}, CPU) on a 2-core machine (the processes, their
threads and what else ran: see the reading below):

```sh
{command}
```

Setup: affinity passes on {args.calib_sequences} × {args.calib_seq_len} tokens of `{args.calib}` (the chain's
pass serves dtp:1, spd:B and dtp:1@K; pt:4's serves pt:2 and pt:4; dtp:2 has its own), optimiser with
{args.restarts} restarts per schedule, optimising J_σ of that schedule (FO units). Every arm distilled with
one recipe: {args.steps} steps of {args.batch_size} × {args.seq_len} tokens of `{args.train}`, lr {args.lr:g}
({args.warmup} warm-up steps, cosine to {args.min_lr:g}), the rest as `docs/study.md`; KL(dense ‖ schedule)
in nats per token on {args.eval_blocks} × {args.seq_len} held-out tokens of `{args.eval}`, at step 0 and after
the budget. Training seed 0 for every arm; at dtp:2 the two optimised layouts with seeds {args.seeds}.

Syncs per token: distinct exchange points (`Schedule.syncs_per_token`, 30 layers = 60 modules); in brackets
the blocking ones, exchanges whose partial is read by the very next module (a_n = n+1), so nothing hides
them. Runtime: `bench/runtime.py`'s two recorded runs in
[benchmarks.md](benchmarks.md#runtime-blocked-time-per-schedule-benchruntimepy) — **a CPU emulation at
L=2** (2 ranks pinned to the 2 cores, a SmolLM2-135M-shaped random model, emulated link latency), not
rerun here: blocked ms/token at 0 µs, then the growth of blocked time at a 2 ms emulated link; its spd
row is spd over the 15 odd layers (the same 45 syncs as spd:isolated:15, other layers).

Plot: `docs/schedules_pareto.png` (quality after distillation vs blocking syncs; the dashed line is the
Pareto front of each schedule's better arm, with tp at KL 0); every evaluation: `docs/schedules_metrics.csv`.

![KL after distillation vs blocking syncs per token](schedules_pareto.png)

## Every schedule

{markdown_table(arms, args.steps)}

{sens_text}

## dtp:2: the δ=2 objective's layout vs the δ=1 layout

{dtp2_seed_table(arms, evaluations, args.steps)}

Wall times per stage (this run; two processes on the two cores): {times}.
"""
    path = docs / "schedules_study.md"
    if path.exists() and NOTES_MARKER in (old := path.read_text()):
        text += "\n" + old[old.index(NOTES_MARKER):]
    path.write_text(text)
    return path


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    command = " ".join([".venv/bin/python bench/schedules_study.py", *(shlex.quote(a) for a in (argv or sys.argv[1:]))])
    if args.model is None:
        from models.io.assets import smollm2_gguf

        args.model = str(smollm2_gguf())
        args.model_name = "SmolLM2-135M-Instruct (packaged GGUF)"
    else:
        args.model_name = args.model
    Path(args.work).mkdir(parents=True, exist_ok=True)
    source = ModelSource(args.model)
    model, tokenizer = None, None
    if not (args.report_only or args.dtp2_table):
        model, tokenizer = load_model(source, device=args.device), load_tokenizer(source)
        log(f"loaded {args.model_name}; {torch.get_num_threads()} threads")
    study = Study(args, model, tokenizer)
    schedules = schedule_names(args, study.shape.num_layers)
    if args.schedules:
        schedules = [s for s in args.schedules.split() if s in schedules]  # in the order given
    seeds = tuple(int(s) for s in args.seeds.split(",") if s.strip())
    if args.dtp2_table:  # a second budget's comparison, kept in its own --work
        arms, evaluations = table_rows(study, ["dtp:2"])
        print(markdown_table(arms, args.steps), "", dtp2_seed_table(arms, evaluations, args.steps), sep="\n")
        return
    if args.step0_only:
        for s in schedules:
            study.step0(s, (CONTIGUOUS,) if s in args.contiguous_only.split() else study.arms(s))
    elif not args.report_only:
        t0 = time.perf_counter()
        run(study, schedules, seeds, args.only_seed_0)
        study._timed(f"total ({args.schedules or 'all'})", t0)
    path = write_outputs(study, schedule_names(args, study.shape.num_layers), command)
    log(f"wrote {path}")


if __name__ == "__main__":
    main()

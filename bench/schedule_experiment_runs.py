"""bench/schedule_experiment.py's runs: the model, the affinity passes, the four arms' layouts and their
distillations, each kept in the work directory so that a rerun does only what is missing."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import psutil
import torch

from bench.schedule_experiment import (
    CONTIGUOUS,
    OPTIMISED,
    OTHER,
    PREDICTORS,
    missing_ffn_damage,
    ranking,
    verdict,
)
from bench.schedule_runs_kept import finished_runs, restore_kept, restore_layouts
from bench.schedule_verdicts import Run, amended_verdict, arm_of, runs_file, slug, write_runs
from models import distill
from models.affinity.file import AffinityResult
from models.data.calibration import CalibrationSpec, load_blocks
from models.distill.checkpoint import CHECKPOINT_DIR, checkpoint_to_read, read_run_state, remove_checkpoint, restore
from models.distill.comparison.compare import run_dir_for
from models.distill.data import place_data
from models.distill.evaluation import DenseReference, evaluate_student
from models.distill.student import make_student
from models.distill.train import make_optimizer
from models.evaluation.spd_auto import resolve_spd_auto
from models.families import model_shape
from models.io.loading import ModelLoadError, ModelSource, load_model, load_tokenizer, resolve_device
from models.layouts import layout as layout_mod
from models.layouts.layout import Layout
from models.optimise import optimise, score, upper_bound
from models.run import pipeline
from models.run.files import AFFINITY_FILE
from models.schedules.grammar import Schedule, ScheduleSpec, parse_schedule, resolve_schedule
from models.variants.set import build_layouts, neuron_agreement, objective_affinity, scored_layout


def truncated(model: Any, layers: int) -> Any:
    """The model's first `layers` decoder layers (the rest dropped): a small setup on the same weights."""
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:layers]
    return model


def refuse_a_layout_again(schedule: str, made: Layout, built: dict[str, Layout], restarts: int,
                          second: str = "restarts") -> None:
    """SystemExit where `made` is an optimised layout already built, up to a relabelling of the devices (with few
    restarts the contiguous start can win for every seed; at spd every seed finds the one exact optimum); what
    to change is named for the way `made` was built (`second`: --second-optimised)."""
    for other, lay in built.items():
        same = neuron_agreement(made, lay)
        if other.startswith(OPTIMISED) and same["neurons"] == 1.0 and same["kv_groups"] == 1.0:
            how = ("raise --restarts, give --second-optimised calibration, or --optimised-layouts 1"
                   if second == "restarts" else
                   "the calibration subset has the whole calibration's optimum: give a longer --calib, "
                   "--second-optimised restarts, or --optimised-layouts 1")
            raise SystemExit(f"{schedule}: {made.name} is {other}'s layout again (--restarts {restarts}, "
                             f"--second-optimised {second}); {how}")


CLAIM_FILE = "training.pid"


@contextlib.contextmanager
def claim(run_dir: Path) -> Iterator[int | None]:
    """This process's claim on a run (run_dir/training.pid, created exclusively): yields None while it holds
    it, or the pid of the live process that does (two processes splitting a set over the cores by --seeds or
    --arms, on one work directory, never train the same run). A claim whose process is gone is taken over."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / CLAIM_FILE
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            try:
                holder = int(path.read_text().strip() or 0)
            except (OSError, ValueError):
                holder = 0
            if holder and holder != os.getpid() and psutil.pid_exists(holder):
                yield holder
                return
            path.unlink(missing_ok=True)  # a stale claim: its process ended without finishing the run
            continue
        with os.fdopen(fd, "w") as f:
            f.write(str(os.getpid()))
        try:
            yield None
        finally:
            path.unlink(missing_ok=True)
        return
    raise RuntimeError(f"{path}: could not claim the run (claimed and released twice while looking)")


def finished_curves(out: Path) -> tuple[dict[str, dict[int, list[tuple[int, float]]]], list[str]]:
    """The primary curves of the finished runs under a schedule's distill folder `out` ({layout: {seed: [(step,
    KL)]}}) and the names of those still running. A run is finished once its secondary.json is written (after
    its last step and the second domain's last evaluation): another process on the same work directory (a set
    split over the cores by --seeds) may be midway through a run whose metrics.json already holds its first
    evaluations, which a verdict must not read as that run's curve."""
    curves: dict[str, dict[int, list[tuple[int, float]]]] = {}
    finished = finished_runs(out)  # the one definition of a finished run, which `keep` reads too
    started = sorted(m.parent for m in (out / "runs").glob("*/seed-*/metrics.json"))
    running = [f"{p.parent.name}/{p.name}" for p in started if p not in finished]
    for run in finished:
        for r in json.loads((run / "metrics.json").read_text())["records"]:
            curves.setdefault(r["layout"], {}).setdefault(int(r["seed"]), []).append((int(r["step"]), r["kl"]))
    return {arm: {seed: sorted(c) for seed, c in by_seed.items()} for arm, by_seed in curves.items()}, running


class Experiment:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        if args.model is None:
            from models.io.assets import smollm2_gguf

            args.model = str(smollm2_gguf())
        source = ModelSource(args.model)
        try:  # refused before the model loads: auto is CUDA when torch sees a GPU (the gpu preset assumes one)
            self.device = resolve_device(args.device)
        except ModelLoadError as exc:
            raise SystemExit(f"--device {args.device}: {exc}; use --device cpu or auto") from None
        self.model = load_model(source, device=str(self.device)).eval()
        if args.layers is not None:
            self.model = truncated(self.model, args.layers)
        self.tokenizer = load_tokenizer(source)
        self.shape = model_shape(self.model.config)
        self.calibration = CalibrationSpec(source=args.calib, sequences=args.calib_sequences,
                                           seq_len=args.calib_seq_len)
        self.work: Path = args.work
        self._blocks: torch.Tensor | None = None
        self._secondary: DenseReference | None = None

    def blocks(self) -> torch.Tensor:
        if self._blocks is None:
            self._blocks = load_blocks(self.calibration, self.tokenizer, vocab_size=int(self.model.config.vocab_size))
        return self._blocks

    def resolved(self, schedule: str) -> str:
        """spd:auto:K / spd:isolated:K → its spd:B (kept in the work directory); any other as is."""
        spec = parse_schedule(schedule)
        if spec.kind != "spd-auto":
            return str(spec)
        path = self.work / f"{slug(schedule)}.json"
        if not path.exists():
            t0 = time.perf_counter()
            blocks = self.blocks()[: self.args.spd_blocks]
            chosen, _, rounds = resolve_spd_auto(spec, self.model, blocks, devices=self.args.devices)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"chosen": str(chosen), "tokens": int(blocks.numel()),
                                        "seconds": time.perf_counter() - t0,
                                        "rounds": [{str(k): v for k, v in r.items()} for r in rounds]}))
        return str(json.loads(path.read_text())["chosen"])

    def schedule(self, schedule: str) -> Schedule:
        return resolve_schedule(self.resolved(schedule), self.shape.num_layers, self.args.devices)

    def affinity(self, schedule: str) -> AffinityResult:
        path = self.work / "affinity" / slug(schedule) / AFFINITY_FILE
        if not path.exists():
            spec = pipeline.OptimiseSpec(devices=self.args.devices, schedule=parse_schedule(self.resolved(schedule)),
                                         export=False)
            # J_σ of σ itself, dtp:1 included (its affinity records σ; a run's objective takes dtp:1 as the chain)
            result = pipeline.run_affinity(self.model, self.blocks(), schedule=self.schedule(schedule), spec=spec,
                                           metadata={"model": str(self.args.model)})
            path.parent.mkdir(parents=True, exist_ok=True)
            result.save(path)
        return AffinityResult.load(path)

    def layouts(self, schedule: str) -> Path:
        """work/layouts/<σ>/{optimised, optimised-seed<k>, contiguous, random-<1000+k> and with --other
        optimised-other}.json, scored in J_σ of σ. A directory that has them is used as it is: its arms are its
        files (bench/edge_intervention.py writes its own set there)."""
        out = self.work / "layouts" / slug(schedule)
        restored = restore_layouts(self.work, schedule, self.args.steps, self.args.kept)
        if restored:
            print(f"{schedule}: layouts {', '.join(restored)} restored from {self.args.kept} (kept by an earlier "
                  "session)", flush=True)
        if not (out / f"{OPTIMISED}.json").exists():
            built = self.build_layouts(schedule)
            for k in range(1, self.args.optimised_layouts):
                made = (self.optimised_seed(schedule, k) if self.args.second_optimised == "restarts"
                        else self.optimised_calibration(schedule, k))
                refuse_a_layout_again(schedule, made, built, self.args.restarts, self.args.second_optimised)
                built[made.name] = made
            for name, lay in built.items():  # all or none: a refused seed leaves no half-built set behind
                lay.save(out / f"{name}.json")
        return out

    def optimised_seed(self, schedule: str, seed: int) -> Layout:
        """Another optimised layout for the amended rule's second optimised layout: the optimiser's random
        restarts drawn with `seed` (`optimised` is seed 0)."""
        result = self.affinity(schedule)  # loaded once: a dense pt:4 affinity file is about 1 GB
        return self.optimised_on(schedule, result, result, f"{OPTIMISED}-seed{seed}", seed=seed)

    def optimised_calibration(self, schedule: str, part: int) -> Layout:
        """Another optimised layout from a calibration subset: the optimiser (seed 0) on the affinity of the
        `part`-th of `--optimised-layouts` equal parts of the calibration blocks, kept in the work directory.
        For a schedule whose optimum every seed finds (spd: each edge alone, J at its exact bound)."""
        parts = self.args.optimised_layouts
        name = f"{OPTIMISED}-calib{part}"
        path = self.work / "affinity" / f"{slug(schedule)}-calib{part}of{parts}" / AFFINITY_FILE
        if not path.exists():
            blocks = self.blocks()  # [B, S]
            subset = blocks[part * len(blocks) // parts:(part + 1) * len(blocks) // parts]
            if len(subset) == 0:
                raise SystemExit(f"{schedule}: {len(blocks)} calibration block(s) cannot be split into {parts} "
                                 "parts; raise --calib-sequences or lower --optimised-layouts")
            spec = pipeline.OptimiseSpec(devices=self.args.devices, schedule=parse_schedule(self.resolved(schedule)),
                                         export=False)
            about = {"model": str(self.args.model), "calibration_part": f"{part}/{parts}"}
            result = pipeline.run_affinity(self.model, subset, schedule=self.schedule(schedule), spec=spec,
                                           metadata=about)
            path.parent.mkdir(parents=True, exist_ok=True)
            result.save(path)
        return self.optimised_on(schedule, AffinityResult.load(path), self.affinity(schedule), name, seed=0)

    def optimised_on(self, schedule: str, result: AffinityResult, full: AffinityResult, name: str, *,
                     seed: int) -> Layout:
        """The optimiser on `result`'s J_σ, the layout scored in J_σ of the schedule's own (`full`) affinity."""
        sched, devices = self.schedule(schedule), self.args.devices
        affinity = objective_affinity(result, "fo", sched)
        best = optimise(affinity, devices, bound=upper_bound(affinity, devices), restarts=self.args.restarts,
                        seed=seed)
        lay = Layout(name, devices, 1, result.shape, best.kv_group_device, best.neuron_device, schedule=str(sched))
        return scored_layout(lay, full, score_name="fo", objective="fo",
                             restarts=self.args.restarts, schedule=sched)

    def build_layouts(self, schedule: str) -> dict[str, Layout]:
        """The first set: optimised, contiguous, the random layouts, and with --other optimised-other."""
        sched = self.schedule(schedule)
        result = self.affinity(schedule)
        built = build_layouts(result, devices=self.args.devices, delta=1, restarts=self.args.restarts,
                              random_layouts=self.args.random_layouts, schedule=sched)
        other = self.schedule(self.args.other) if self.args.other else sched
        if str(other) != str(sched):
            chain = other.name == "dtp:1"
            made = build_layouts(result if chain else self.affinity(self.args.other), devices=self.args.devices,
                                 delta=1, restarts=self.args.restarts, schedule=None if chain else other)[OPTIMISED]
            built[OTHER] = scored_layout(made.with_name(OTHER), result, score_name="fo", objective="fo",
                                         restarts=self.args.restarts, schedule=sched)
        return built

    def arms(self, schedule: str) -> list[str]:
        return sorted(p.stem for p in self.layouts(schedule).glob("*.json"))

    def chosen_arms(self, schedule: str) -> list[str] | None:
        """--arms, checked against the schedule's layouts (None: every one)."""
        if self.args.arms is None:
            return None
        chosen = [a.strip() for a in self.args.arms.split(",") if a.strip()]
        known = self.arms(schedule)
        unknown = [a for a in chosen if a not in known]
        if unknown or not chosen:
            raise SystemExit(f"--arms {self.args.arms!r}: {', '.join(unknown) or 'none given'} not among "
                             f"{schedule}'s layouts ({', '.join(known)})")
        return chosen

    def predictors(self, schedule: str, result: AffinityResult | None = None) -> dict[str, dict[str, float]]:
        """{predictor: {arm: value}}: J_σ damage-weighted and unit-mass, and minus the missing FFN damage, on
        `result` (default: the work directory's affinity of σ)."""
        sched = self.schedule(schedule)
        sigma = (result or self.affinity(schedule)).schedule_affinity("fo", sched)
        out: dict[str, dict[str, float]] = {p: {} for p in PREDICTORS}
        for arm in self.arms(schedule):
            lay = layout_mod.load(self.layouts(schedule) / f"{arm}.json")
            damage = score(sigma, lay.kv_group_device, lay.neuron_device, devices=self.args.devices)
            unit = score(sigma.with_weighting("unit"), lay.kv_group_device, lay.neuron_device,
                         devices=self.args.devices)
            out["J_damage"][arm], out["J_unit"][arm] = damage.J, unit.J
            out["neg_missing_ffn_damage"][arm] = -missing_ffn_damage(damage.edges)
        return out

    def recipe(self) -> distill.DistillRecipe:
        a = self.args
        return distill.DistillRecipe(steps=a.steps, batch_size=a.batch_size, micro_batch_size=a.batch_size, lr=a.lr,
                                     min_lr=a.lr / 10, warmup_steps=max(1, a.steps // 10), eval_every=a.eval_every,
                                     checkpoint_every=10, eval_batch_size=4)

    def secondary(self) -> DenseReference:
        """The second domain's evaluation blocks and the dense model on them (computed once)."""
        if self._secondary is None:
            a = self.args
            blocks = load_blocks(CalibrationSpec(source=a.eval2, sequences=a.eval2_blocks, seq_len=a.seq_len),
                                 self.tokenizer, vocab_size=int(self.model.config.vocab_size))
            self._secondary = DenseReference.compute(self.model, blocks, recipe=self.recipe())
        return self._secondary

    def distill_spec(self, schedule: str, arm: str, seed: int) -> distill.DistillSpec:
        a = self.args
        return distill.DistillSpec(
            layouts=(arm,), devices=a.devices, delta=1, seeds=(seed,), recipe=self.recipe(),
            train=CalibrationSpec(source=a.train, sequences=a.steps * a.batch_size, seq_len=a.seq_len),
            eval=CalibrationSpec(source=a.eval, sequences=a.eval_blocks, seq_len=a.seq_len),
            calibration=self.calibration, schedule=parse_schedule(self.resolved(schedule)))

    def train(self, schedule: str, arms: list[str] | None = None
              ) -> tuple[dict[str, dict[int, list[tuple[int, float]]]], dict[str, list[float]]]:
        """Every arm (or only `arms`) × seed distilled under σ, one run at a time, then every finished run of
        the schedule read back from its own files, whichever process trained it: ({arm: {seed: [(step, kl)]}} on
        the primary evaluation set, {arm: [final KL on the second domain per seed]})."""
        a = self.args
        seeds = tuple(int(s) for s in a.seeds.split(","))
        out = self.work / "distill" / slug(schedule)
        recipe = self.recipe()
        for name in restore_kept(self.work, schedule, recipe.steps, self.layouts(schedule), self.args.kept):
            print(f"{schedule}: run {name} restored from {self.args.kept} (kept by an earlier session)", flush=True)
        for arm in arms if arms is not None else self.arms(schedule):
            for seed in seeds:
                spec = self.distill_spec(schedule, arm, seed)
                run_dir = run_dir_for(out, arm, seed)
                done = run_dir / "secondary.json"
                if done.exists():
                    continue
                with claim(run_dir) as other:
                    if other is not None:
                        print(f"{schedule}: run {arm}/seed-{seed} is being trained by process {other}: skipped",
                              flush=True)
                        continue
                    if done.exists():  # finished by another process between the two looks
                        continue
                    # keep the final weights until the second domain has evaluated them
                    layout_file = self.layouts(schedule) / f"{arm}.json"
                    curve = self.second_curve(run_dir)
                    distill.run_distill(spec, teacher=self.model, tokenizer=self.tokenizer, out_dir=out,
                                        layouts_dir=self.layouts(schedule), keep_checkpoints=True, plot=False,
                                        on_eval_student=partial(self.second_record, run_dir, recipe, curve))
                    if recipe.steps not in curve:  # a run read back whole (its metrics.json complete)
                        curve[recipe.steps] = self.evaluate_final(run_dir, layout_file, spec.schedule, recipe)
                    done.write_text(json.dumps({"source": a.eval2, "tokens": a.eval2_blocks * a.seq_len,
                                                "kl": curve[recipe.steps], "curve": sorted(curve.items())}))
                    remove_checkpoint(run_dir / CHECKPOINT_DIR)
                    (run_dir / "secondary-partial.json").unlink(missing_ok=True)  # secondary.json has its points
        curves, running = finished_curves(out)
        for name in running:
            print(f"{schedule}: run {name} is not finished (no secondary.json): left out of this set's curves",
                  flush=True)
        secondary = {layout: [float(json.loads((run_dir_for(out, layout, seed) / "secondary.json").read_text())["kl"])
                              for seed in sorted(by_seed)] for layout, by_seed in curves.items()}
        return curves, secondary

    def runs(self, schedule: str, curves: dict[str, dict[int, list[tuple[int, float]]]]) -> list[Run]:
        """Each (layout, seed) run as the verdict rule reads it, with its second domain's curve (or, for runs
        made before the curve was kept, its KL after the last step) from the run's own secondary.json."""
        out = []
        for layout, by_seed in curves.items():
            for seed, curve in sorted(by_seed.items()):
                done = run_dir_for(self.work / "distill" / slug(schedule), layout, seed) / "secondary.json"
                second: tuple[tuple[int, float], ...] = ()
                if done.exists():
                    kept = json.loads(done.read_text())
                    second = tuple((int(st), float(kl)) for st, kl in kept["curve"]) if "curve" in kept else \
                        ((curve[-1][0], float(kept["kl"])),)
                out.append(Run(arm_of(layout), layout, seed, tuple(curve), second))
        return out

    @staticmethod
    def second_curve(run_dir: Path) -> dict[int, float]:
        """The second domain's points of an interrupted run so far ({step: KL}, kept beside its checkpoint)."""
        kept = run_dir / "secondary-partial.json"
        return {int(k): float(v) for k, v in json.loads(kept.read_text()).items()} if kept.exists() else {}

    def second_record(self, run_dir: Path, recipe: distill.DistillRecipe, curve: dict[int, float], record: Any,
                      student: Any) -> None:
        """run_distill's on_eval_student: the second domain's KL of the student the primary evaluation just
        measured, at its step; kept in secondary-partial.json so that a resumed run keeps its curve."""
        curve[int(record.step)], _ = evaluate_student(student, self.model, self.secondary(), recipe=recipe)
        (run_dir / "secondary-partial.json").write_text(json.dumps({str(k): v for k, v in sorted(curve.items())}))

    def evaluate_final(self, run_dir: Path, layout_file: Path, schedule: ScheduleSpec | None,
                       recipe: distill.DistillRecipe) -> float:
        """KL(dense ‖ student) on the second domain of the run's final weights (its kept checkpoint)."""
        lay = layout_mod.load(layout_file)
        student = make_student(self.model, lay, recipe, schedule)
        found = checkpoint_to_read(run_dir / CHECKPOINT_DIR)
        if found is None:
            raise RuntimeError(f"{run_dir}: no final checkpoint to evaluate on the second domain")
        restore(found, read_run_state(found), student, make_optimizer(student, recipe))
        kl, _ = evaluate_student(student, self.model, self.secondary(), recipe=recipe)
        return kl

    def step0(self, schedule: str) -> dict[str, Any]:
        """No training: each arm's KL(dense ‖ σ) at step 0 on the blocks training evaluates (held out from the
        calibration and training text, as `models.distill` places them), against the predictors."""
        from models.evaluation.evaluate import evaluate

        t0 = time.perf_counter()
        # the blocks training's step 0 evaluates: held out from the calibration and training text
        held_out = place_data(self.distill_spec(schedule, OPTIMISED, 0)).eval
        blocks = load_blocks(held_out, self.tokenizer, vocab_size=int(self.model.config.vocab_size))
        predicted = self.predictors(schedule)
        kl0 = {arm: [evaluate(self.model, layout_mod.load(self.layouts(schedule) / f"{arm}.json"), blocks,
                              schedule=self.resolved(schedule)).kl] for arm in self.arms(schedule)}
        row = {"resolved": self.resolved(schedule), "device": str(self.device), "predictors": predicted,
               "step0_kl": kl0,
               "ranking": {p: ranking(predicted[p], kl0) for p in PREDICTORS}, "verdict": None,
               "seconds": time.perf_counter() - t0}
        (self.work / f"step0-{slug(schedule)}.json").write_text(json.dumps(row, indent=1))
        return row

    def run(self, schedule: str) -> dict[str, Any]:
        if self.args.step0_only:
            return self.step0(schedule)
        t0 = time.perf_counter()
        predicted = self.predictors(schedule)
        curves, secondary = self.train(schedule, self.chosen_arms(schedule))
        finals = {arm: [c[-1][1] for _, c in sorted(by_seed.items())] for arm, by_seed in curves.items()}
        row = {"resolved": self.resolved(schedule), "device": str(self.device), "predictors": predicted,
               "final_kl": finals,
               "final_kl_second_domain": secondary, "curves": curves,
               "ranking": {p: ranking(predicted[p], finals) for p in PREDICTORS},
               "verdict": verdict(curves) if {OPTIMISED, CONTIGUOUS} <= curves.keys() else None,
               "amended_verdict": amended_verdict(self.runs(schedule, curves)),
               "seconds": time.perf_counter() - t0}
        (self.work / f"result-{slug(schedule)}.json").write_text(json.dumps(row, indent=1))
        self.write_runs(schedule, row)
        return row

    def write_runs(self, schedule: str, row: dict[str, Any]) -> None:
        """The schedule's runs file (bench/schedule_verdicts.py's format: the verdicts' only input)."""
        a = self.args
        setup = {k: getattr(a, k) for k in ("preset", "devices", "batch_size", "seq_len", "lr", "eval_every", "calib",
                                            "calib_sequences", "calib_seq_len", "restarts", "train", "eval",
                                            "eval_blocks", "eval2", "eval2_blocks", "layers")}
        write_runs(runs_file(a.runs_dir, schedule, a.steps), schedule, a.steps, self.runs(schedule, row["curves"]),
                   resolved=row["resolved"], device=row["device"], model=Path(str(a.model)).name, setup=setup,
                   source="bench/schedule_experiment.py")

"""The stages of a run, declared once: `dtp-layout optimise`, `dtp-layout distill` and a worker's job
all run this list through `models.run.runner.run_stages`; each supplies its run's plan (models.run.plan: which
stages apply and with what), its hooks and where it runs (`RunContext.of(plan, …)`).

  loading      config (always; L, δ, the schedule and the memory limit checked by models.run.rules), weights
               and tokenizer when a stage still to run needs them (re-done on every run: they live in
               memory), a GGUF's from its converted copy when the caller gives a
               `models.io.converted.ConvertedCache`
  calibration  token blocks → blocks.npy (not read when the affinity is already there and no stage
               still to run reads the blocks)
  affinity     blocks.npy → affinity.safetensors (where `AffinityStore` keeps it: the run directory,
               or the worker's per-tenant cache)
  optimising   affinity → layouts/*.json
  probing      (when asked) K candidate layouts distilled S steps each on the calibration text, the lowest
               held-out KL chosen for the export → probe/ (`models.probe`)
  stability    (when asked) an affinity pass and the optimiser on each half of the blocks →
               stability/*.json and stability.json, the report (`models.variants.stability`)
  exporting    (when asked) the optimised layout's checkpoint/ and/or shards/
  distilling   (when asked) `models.distill.run_distill`, resumable run by run from its checkpoints

Torch and the model code are imported inside the stages; this module imports without torch.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from models.io.atomic import atomic_write_json
from models.run.files import (
    AFFINITY_FILE,
    ARTIFACTS,
    BLOCKS_FILE,
    DISTILL_DIR,
    EXPORT_DIRS,
    LAYOUTS_DIR,
    PROBE_DIR,
    STABILITY_DIR,
    STABILITY_FILE,
)
from models.run.plan import RunPlan
from models.run.rules import memory_refusals, model_refusals, raise_first
from models.run.runner import Hooks, Note, Stage, StageContext
from models.run.stage_names import STAGES as STAGE_ORDER
from models.schedules.grammar import ScheduleSpec


class AffinityStore:
    """Where the affinity pass's result is kept: here, the run directory itself (the worker keeps it in
    a per-tenant cache shared by jobs of the same fingerprint: worker.publishing.CachedAffinity)."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / AFFINITY_FILE

    def lookup(self) -> bool | None:
        """None: not there, compute it; True: made by another run (a cache hit); False: made by this
        run earlier. Here always None: a result not recorded as done is computed again."""
        return None

    def publish(self, produced: Path) -> None:
        """Make the file the pass wrote (run directory / AFFINITY_FILE) the stored result."""
        if produced != self.path:
            produced.replace(self.path)


@dataclass
class DistillOutput:
    """Where the distilling stage writes (out_dir; None: the run directory's distill/) and reads the layouts
    by name (layouts_dir; None: none, only contiguous, random-SEED and layout files), with the caller's
    callbacks for each evaluation, step and run start. What it runs is the plan's `distill` (a
    models.distill.spec.DistillSpec)."""

    out_dir: Path | None = None
    layouts_dir: Path | None = None
    plot: bool = True
    keep_checkpoints: bool = True
    on_eval: Callable[[Any], None] | None = None
    on_step: Callable[[str, int, Any, Any], None] | None = None
    on_run_start: Callable[[str, int], None] | None = None


@dataclass(kw_only=True)
class RunContext(RunPlan, StageContext):
    """One run: its plan (models.run.plan.RunPlan: what the stages run and with what), where and how it runs
    (what the caller fills in), and what the stages produce."""

    run_dir: Path
    source: Callable[[], Any]  # → models.io.loading.ModelSource (the worker resolves and re-checks it here)
    device: str
    distill_output: DistillOutput | None = None
    affinity: AffinityStore | None = None
    # models.io.converted.ConvertedCache: a GGUF source's weights are loaded from its converted copy (made
    # by the first run that needs them); None: dequantised from the GGUF on every load
    converted: Any = None
    # made by the stages
    config: Any = None
    model: Any = None
    # models.streaming.layer_source.StreamedModel: the model on the meta device, read layer by layer
    streamed: Any = None
    memory: Any = None  # models.streaming.memory_plan.MemoryPlan
    tokenizer: Any = None
    state: Any = None  # models.run.pipeline.RunState
    distill_summary: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, plan: RunPlan, **where: Any) -> RunContext:
        """The run of `plan`, with the caller's `where` (run_dir, source, device, the stores, the callbacks)."""
        return cls(**{f.name: getattr(plan, f.name) for f in dataclasses.fields(RunPlan)}, **where)

    def run_state(self) -> Any:
        if self.state is None:
            from models.run import pipeline
            self.state = pipeline.RunState(out_dir=self.run_dir)
        return self.state


def _applies(name: str) -> Callable[[RunContext], bool]:
    def applies(ctx: RunContext) -> bool:
        return name in ctx.stage_names
    return applies


def _affinity_there(ctx: RunContext) -> bool:
    return ctx.affinity is not None and ctx.affinity.lookup() is not None


def _blocks_needed(ctx: RunContext) -> bool:
    """Whether a stage still to run reads the calibration blocks (the affinity pass does not when its
    result is there already)."""
    return "stability" in ctx.pending or ("affinity" in ctx.pending and not _affinity_there(ctx))


def weights_of(ctx: RunContext) -> Any:
    """The loaded model, or the streamed one (its skeleton carries the config)."""
    return ctx.streamed if ctx.streamed is not None else ctx.model


def needs_weights(ctx: RunContext) -> bool:
    """Whether a stage still to run needs the model's weights (not when the affinity is there already
    and nothing after it runs the model)."""
    if ctx.pending & {"probing", "stability", "exporting", "distilling"}:
        return True
    return bool(ctx.pending & {"calibration", "affinity"}) and not _affinity_there(ctx)


# ---- the stages' work ---------------------------------------------------------------------------------

def _load(ctx: RunContext, hooks: Hooks) -> Note:
    from models.families import model_shape
    from models.io.loading import ModelSource, load_config

    source = ctx.source()
    # A GGUF's config read from its converted copy when there is one: parsing the GGUF's metadata (its
    # tokenizer's vocabulary included) is seconds of its own (docs/benchmarks.md). The copy's config.json
    # names its dtype, the compute dtype (its key): what an `auto` export of a GGUF follows anyway.
    copy = ctx.converted.lookup(source, dtype=ctx.dtype) if ctx.converted is not None else None
    ctx.config = load_config(ModelSource(str(copy)) if copy is not None else source)
    # The rules the API's submit check also asks (models/run/rules.py): L, δ and the schedule against the model
    # (spd:auto:K: K now, its layers chosen by the affinity stage), then the memory limit, before any weight
    # is read. A streamed affinity pass is refused only where one is still to run.
    raise_first(model_refusals(ctx.facts, model_shape(ctx.config)))
    ctx.memory, refusals = memory_refusals(ctx.facts, ctx.config, limit=ctx.max_memory, stream=ctx.stream,
                                           affinity_pass=_blocks_needed(ctx))
    raise_first(refusals)
    hooks.progress("loading", 0.05)
    note: dict[str, Any] = {}
    if needs_weights(ctx):
        from models.streaming.weights import open_weights

        weights = open_weights(source, ctx.config, plan=ctx.memory, dtype=ctx.dtype, device=ctx.device,
                               converted=ctx.converted)  # converted only when the weights are needed
        if ctx.memory.stream:
            ctx.streamed = weights.model
            ctx.streamed.memory_plan = ctx.memory
            note["streamed"] = ctx.memory.describe()
        else:
            ctx.model = weights.model
            if weights.read_from != source:
                note["converted"] = "reused" if copy is not None else "made"
        ctx.tokenizer = weights.tokenizer
        hooks.progress("loading", 0.9)
    return {"weights": ctx.model is not None or ctx.streamed is not None, **note}


def _calibrate(ctx: RunContext, _hooks: Hooks) -> Note:
    from models.run import pipeline
    if not _blocks_needed(ctx):
        return {"skipped": "affinity cached"}
    state = ctx.run_state()
    pipeline.stage_calibration(state, model=weights_of(ctx), tokenizer=ctx.tokenizer, calibration=ctx.calibration)
    _save_blocks(ctx.run_dir / BLOCKS_FILE, state.blocks)
    return {"tokens": int(state.blocks.numel())}


def _save_blocks(path: Path, blocks: Any) -> None:
    import numpy as np

    tmp = path.with_name(path.name + ".tmp.npy")
    np.save(tmp, blocks.numpy())
    tmp.replace(path)


def _restore_blocks(ctx: RunContext) -> None:
    import numpy as np
    import torch

    if not _blocks_needed(ctx):  # recorded as skipped: the affinity was cached
        return
    ctx.run_state().blocks = torch.from_numpy(np.load(ctx.run_dir / BLOCKS_FILE))


def _affinity(ctx: RunContext, hooks: Hooks) -> Note:
    from models.run import pipeline
    store = ctx.affinity or AffinityStore(ctx.run_dir)
    found = store.lookup()
    if found is None:
        pipeline.stage_affinity(ctx.run_state(), model=weights_of(ctx), spec=ctx.optimise, model_name=ctx.model_id,
                                calibration=ctx.calibration_shown, progress=hooks.progress,
                                should_stop=hooks.should_stop)
        store.publish(ctx.run_dir / AFFINITY_FILE)
    _restore_affinity(ctx)  # what a resumed run reads: the same numbers, whichever run computed them
    return {"cached": bool(found)}


def _restore_affinity(ctx: RunContext) -> None:
    from models.affinity.scoring import AffinityResult

    store = ctx.affinity or AffinityStore(ctx.run_dir)
    ctx.run_state().affinity = AffinityResult.load(store.path)
    # spd:auto:K: the spd:B this affinity was computed for is the run's schedule from now on (into the plan)
    ctx.resolve_schedule(ctx.run_state().affinity.schedule)


def _schedule_now(ctx: RunContext) -> ScheduleSpec:
    """The run's schedule for the stages after the affinity: spd:auto:K's chosen spd:B (read back from the
    affinity file where no stage of this run restored it)."""
    if ctx.schedule_pending:
        _restore_affinity(ctx)
    return ctx.schedule


def _optimise(ctx: RunContext, hooks: Hooks) -> Note:
    from models.run import pipeline
    shutil.rmtree(ctx.run_dir / LAYOUTS_DIR, ignore_errors=True)
    pipeline.stage_layouts(ctx.run_state(), spec=ctx.optimise, progress=hooks.progress)
    _restore_layouts(ctx)
    return {"layouts": len(ctx.run_state().layouts)}


def _restore_layouts(ctx: RunContext) -> None:
    """The layouts as saved, in name order (a resumed run reports them as the first did)."""
    from models.layouts.layout import load

    ctx.run_state().layouts = {p.stem: load(p) for p in sorted((ctx.run_dir / LAYOUTS_DIR).glob("*.json"))}


def _probe(ctx: RunContext, hooks: Hooks) -> Note:
    """The training probe (models.probe): K candidates distilled S steps each, the lowest held-out KL exported."""
    import sys

    from models.probe.candidates import probe_candidates
    from models.probe.probe import run_probe

    state, spec = ctx.run_state(), ctx.optimise
    assert state.affinity is not None and ctx.probe is not None and spec is not None
    objective = spec.objective_schedule(state.affinity.shape.num_layers, state.affinity.schedule)
    candidates = probe_candidates(state.affinity, count=ctx.probe.candidates, devices=spec.devices, delta=spec.delta,
                                  score_name=spec.score, restarts=spec.restarts, schedule=objective,
                                  optimised=state.layouts.get("optimised"))
    schedule = _schedule_now(ctx)  # spd:auto:K: its chosen spd:B; the students simulate it, as a distillation's
    record = run_probe(ctx.probe, teacher=ctx.model, tokenizer=ctx.tokenizer, candidates=candidates,
                       calibration=ctx.calibration, schedule=schedule,
                       out_dir=ctx.run_dir / PROBE_DIR, model_id=ctx.model_id, progress=hooks.progress,
                       should_stop=hooks.should_stop,
                       announce=lambda line: print(f"probe: {line}", file=sys.stderr, flush=True))
    _restore_probe(ctx)
    return {"chosen": record["chosen"], "candidates": len(candidates)}


def _restore_probe(ctx: RunContext) -> None:
    from models.probe.probe import chosen_layout, read_probe

    state = ctx.run_state()
    state.probe = read_probe(ctx.run_dir / PROBE_DIR)
    state.chosen = chosen_layout(ctx.run_dir / PROBE_DIR, state.probe)


def _stabilise(ctx: RunContext, hooks: Hooks) -> Note:
    from models.run import pipeline
    shutil.rmtree(ctx.run_dir / STABILITY_DIR, ignore_errors=True)
    state = ctx.run_state()
    pipeline.stage_stability(state, model=weights_of(ctx), spec=ctx.optimise, progress=hooks.progress,
                             should_stop=hooks.should_stop)
    atomic_write_json(ctx.run_dir / STABILITY_FILE, state.stability)
    _restore_stability(ctx)
    return {"transfer": state.stability["transfer"]}


def _restore_stability(ctx: RunContext) -> None:
    ctx.run_state().stability = json.loads((ctx.run_dir / STABILITY_FILE).read_text())


def export_dtypes(ctx: RunContext) -> dict[str, str]:
    """The dtype the export stores and the one the passes computed in, by name."""
    from models.export.files import dtype_name, export_dtype
    from models.io.loading import DTYPES

    compute = DTYPES[ctx.dtype]
    return {"dtype": dtype_name(export_dtype(ctx.export_dtype, config=ctx.config, compute=compute)),
            "compute_dtype": dtype_name(compute)}


def _export(ctx: RunContext, hooks: Hooks) -> Note:
    from models.export.files import export_dtype
    from models.io.loading import DTYPES
    from models.run import pipeline

    for sub in EXPORT_DIRS:
        shutil.rmtree(ctx.run_dir / sub, ignore_errors=True)
    # The checkpoint and the shards are written together, tensor by tensor, which reports progress.
    pipeline.stage_export(ctx.run_state(), model=weights_of(ctx), tokenizer=ctx.tokenizer,
                          progress=lambda _name, f: hooks.progress("exporting", f),
                          overwrite=True, checkpoint=ctx.checkpoint, shards=ctx.shards, schedule=_schedule_now(ctx),
                          dtype=export_dtype(ctx.export_dtype, config=ctx.config, compute=DTYPES[ctx.dtype]))
    return {}


def _restore_export(ctx: RunContext) -> None:
    ctx.run_state().export_dtypes = export_dtypes(ctx)


def _distil(ctx: RunContext, hooks: Hooks) -> Note:
    from models import distill

    _schedule_now(ctx)  # spd:auto:K: the students run the spd:B the affinity stage chose (written into the plan)
    spec = ctx.distill
    assert spec is not None
    out = ctx.distill_output or DistillOutput()
    ctx.distill_summary = distill.run_distill(
        spec, teacher=ctx.model, tokenizer=ctx.tokenizer, out_dir=out.out_dir or ctx.run_dir / DISTILL_DIR,
        layouts_dir=out.layouts_dir, model_id=ctx.model_id, progress=hooks.progress,
        should_stop=hooks.should_stop, on_eval=out.on_eval, on_step=out.on_step, on_run_start=out.on_run_start,
        plot=out.plot, keep_checkpoints=out.keep_checkpoints, abandonable=hooks.abandonable)
    runs = len(spec.layouts) * len(spec.seeds)
    return {"runs": runs, "total_steps": runs * spec.recipe.steps}


# ---- the list ------------------------------------------------------------------------------------------

STAGES: tuple[Stage[RunContext], ...] = (
    Stage("loading", _load, resumable=False),
    Stage("calibration", _calibrate, outputs=(BLOCKS_FILE,), applies=_applies("calibration"),
          restore=_restore_blocks),
    Stage("affinity", _affinity, inputs=(BLOCKS_FILE,), outputs=(AFFINITY_FILE,), applies=_applies("affinity"),
          restore=_restore_affinity, checks_stop=True),
    Stage("optimising", _optimise, inputs=(AFFINITY_FILE,), outputs=(LAYOUTS_DIR,),
          applies=_applies("optimising"),
          restore=_restore_layouts),
    Stage("probing", _probe, inputs=(AFFINITY_FILE, LAYOUTS_DIR), outputs=(PROBE_DIR,), applies=_applies("probing"),
          restore=_restore_probe, checks_stop=True),
    Stage("stability", _stabilise, inputs=(BLOCKS_FILE,), outputs=(STABILITY_DIR, STABILITY_FILE),
          applies=_applies("stability"), restore=_restore_stability),
    Stage("exporting", _export, inputs=(LAYOUTS_DIR, PROBE_DIR), outputs=EXPORT_DIRS, applies=_applies("exporting"),
          restore=_restore_export),
    Stage("distilling", _distil, inputs=(LAYOUTS_DIR,), outputs=(DISTILL_DIR,), applies=_applies("distilling"),
          checks_stop=True),
)
# The names are declared once, dependency-free (models.run.stage_names: the API and the dashboard read them
# without importing this module); the stage list must run them in that order.
if tuple(stage.name for stage in STAGES) != STAGE_ORDER:
    raise RuntimeError(f"models.run.stages runs {[s.name for s in STAGES]}, "
                       f"models.run.stage_names says {list(STAGE_ORDER)}")


def _check_artifacts() -> None:
    """What a stage publishes is declared once (models.run.files.ARTIFACTS), each from the stage's own outputs."""
    outputs = {stage.name: stage.outputs for stage in STAGES}
    for artifact in ARTIFACTS:
        if artifact.stage is not None and artifact.pattern.split("/")[0] not in outputs.get(artifact.stage, ()):
            raise RuntimeError(f"models.run.files.ARTIFACTS: {artifact.pattern!r} is published by {artifact.stage!r}, "
                               "which does not write it")


_check_artifacts()
# What the report reads after the run: restored from finished stages even when nothing runs after them.
REPORT_INPUTS = (AFFINITY_FILE, LAYOUTS_DIR, PROBE_DIR, STABILITY_FILE, *EXPORT_DIRS)


def build_report(ctx: RunContext, *, seconds: dict[str, float] | None = None, calibration_identity: str | None = None,
                 data: dict[str, Any] | None = None) -> dict[str, Any]:
    """report.json of the run (models.run.pipeline.build_report) with the stages' wall seconds."""
    from models.run import pipeline
    state = ctx.run_state()
    state.seconds = dict(seconds or {})
    return pipeline.build_report(state, spec=ctx.optimise, model_name=ctx.model_id, calibration=ctx.calibration_shown,
                                 calibration_identity=calibration_identity, data=data)

"""The stages of a run, declared once: `dtp-layout optimise`, `dtp-layout distill` and a worker's job
all run this list through `models.run.runner.run_stages`; each supplies only its hooks and its context.

  loading      config (always; the device count and δ checked), weights and tokenizer when a stage
               still to run needs them (re-done on every run: they live in memory), a GGUF's from its
               converted copy when the caller gives a `models.io.converted.ConvertedCache`
  calibration  token blocks → blocks.npy (not read when the affinity is already there and no stage
               still to run reads the blocks)
  affinity     blocks.npy → affinity.safetensors (where `AffinityStore` keeps it: the run directory,
               or the worker's per-tenant cache)
  optimising   affinity → layouts/*.json
  stability    (when asked) an affinity pass and the optimiser on each half of the blocks →
               stability/*.json and stability.json, the report (`models.layouts.stability`)
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
    STABILITY_DIR,
    STABILITY_FILE,
)
from models.run.runner import Hooks, Note, Stage, StageContext
from models.run.stage_names import STAGES as STAGE_ORDER


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
class DistillPlan:
    """What the distilling stage runs (a `models.distill.DistillSpec`) and where, with the caller's
    callbacks for each evaluation, step and run start."""

    spec: Any
    out_dir: Path
    layouts_dir: Path | None
    plot: bool = True
    keep_checkpoints: bool = True
    on_eval: Callable[[Any], None] | None = None
    on_step: Callable[[str, int, Any, Any], None] | None = None
    on_run_start: Callable[[str, int], None] | None = None


@dataclass
class RunContext(StageContext):
    """One run's inputs (what the caller fills in) and what the stages produce."""

    run_dir: Path
    model_id: str  # as shown in the report
    source: Callable[[], Any]  # → models.io.loading.ModelSource (the worker resolves and re-checks it here)
    dtype: str  # compute dtype
    device: str
    devices: int
    delta: int
    # The communication schedule (models.schedules.grammar, canonical) the shards are exported for and the
    # students simulate; None: dtp:δ. Checked against the model's depth at loading.
    schedule: str | None = None
    optimise: Any = None  # models.run.pipeline.OptimiseSpec; None: no optimise stages (`dtp-layout distill`)
    calibration: Any = None  # models.data.calibration.CalibrationSpec, as read (a server path)
    calibration_shown: Any = None  # the same, as given (recorded in the affinity file and the report)
    checkpoint: bool = False
    shards: bool = False
    export_dtype: str = "auto"
    distill: DistillPlan | None = None
    affinity: AffinityStore | None = None
    # models.io.converted.ConvertedCache: a GGUF source's weights are loaded from its converted copy (made
    # by the first run that needs them); None: dequantised from the GGUF on every load
    converted: Any = None
    # the memory limit in bytes (None: none) and whether to stream (None: when the model would not fit
    # under the limit; models.streaming.memory_plan)
    max_memory: int | None = None
    stream: bool | None = None
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

    def run_state(self) -> Any:
        if self.state is None:
            from models.run import pipeline
            self.state = pipeline.RunState(out_dir=self.run_dir)
        return self.state


def _optimising(ctx: RunContext) -> bool:
    return ctx.optimise is not None


def _stability(ctx: RunContext) -> bool:
    return ctx.optimise is not None and bool(ctx.optimise.stability)


def _exporting(ctx: RunContext) -> bool:
    return ctx.optimise is not None and (ctx.checkpoint or ctx.shards)


def _distilling(ctx: RunContext) -> bool:
    return ctx.distill is not None


def _affinity_there(ctx: RunContext) -> bool:
    return ctx.affinity is not None and ctx.affinity.lookup() is not None


def _blocks_needed(ctx: RunContext) -> bool:
    """Whether a stage still to run reads the calibration blocks (the affinity pass does not when its
    result is there already)."""
    return "stability" in ctx.pending or ("affinity" in ctx.pending and not _affinity_there(ctx))


def weights_of(ctx: RunContext) -> Any:
    """The loaded model, or the streamed one (its skeleton carries the config)."""
    return ctx.streamed if ctx.streamed is not None else ctx.model


def _memory_plan(ctx: RunContext) -> Any:
    """How the run fits `max_memory` (models.streaming.memory_plan): raises MemoryLimitError before any weight
    is read."""
    from models.streaming.memory_plan import MemoryLimitError, plan_memory

    tokens = batch_tokens = 0
    if ctx.calibration is not None and ctx.optimise is not None:
        tokens = ctx.calibration.sequences * ctx.calibration.seq_len
        batch_tokens = min(ctx.calibration.sequences, ctx.optimise.batch_size) * ctx.calibration.seq_len
    plan = plan_memory(ctx.config, dtype=ctx.dtype, command="optimise", limit=ctx.max_memory, tokens=tokens,
                       batch_tokens=batch_tokens, export=_exporting(ctx), stream=ctx.stream)
    if plan.stream and _distilling(ctx):
        raise MemoryLimitError("distillation holds the whole student and teacher and does not stream: "
                               f"{plan.describe()}; raise max_memory or run the distillation without it")
    return plan


def needs_weights(ctx: RunContext) -> bool:
    """Whether a stage still to run needs the model's weights (not when the affinity is there already
    and nothing after it runs the model)."""
    if ctx.pending & {"stability", "exporting", "distilling"}:
        return True
    return bool(ctx.pending & {"calibration", "affinity"}) and not _affinity_there(ctx)


# ---- the stages' work ---------------------------------------------------------------------------------

def _load(ctx: RunContext, hooks: Hooks) -> Note:
    from models.families import model_shape
    from models.io.loading import ModelSource, load_config, load_model, load_tokenizer
    from models.layouts.layout import check_delta, check_devices
    from models.schedules.grammar import check_schedule

    source = ctx.source()
    # A GGUF's config read from its converted copy when there is one: parsing the GGUF's metadata (its
    # tokenizer's vocabulary included) is seconds of its own (docs/benchmarks.md). The copy's config.json
    # names its dtype, the compute dtype (its key): what an `auto` export of a GGUF follows anyway.
    copy = ctx.converted.lookup(source, dtype=ctx.dtype) if ctx.converted is not None else None
    ctx.config = load_config(ModelSource(str(copy)) if copy is not None else source)
    shape = model_shape(ctx.config)
    check_devices(shape, ctx.devices)
    check_delta(shape, ctx.delta)
    if ctx.schedule is not None:  # spd:auto:K: K checked now, its layers chosen by the affinity stage
        check_schedule(ctx.schedule, shape.num_layers, ctx.devices)  # a ScheduleError names what does not fit
    ctx.memory = _memory_plan(ctx)
    hooks.progress("loading", 0.05)
    note: dict[str, Any] = {}
    if needs_weights(ctx) and ctx.memory.stream:
        from models.io.loading import DTYPES, resolve_device
        from models.streaming.layer_source import StreamedModel, checkpoint_directory

        directory = checkpoint_directory(source, dtype=ctx.dtype, converted=ctx.converted)
        ctx.streamed = StreamedModel(directory, ctx.config, dtype=DTYPES[ctx.dtype], device=resolve_device(ctx.device))
        ctx.streamed.memory_plan = ctx.memory
        ctx.tokenizer = load_tokenizer(ModelSource(str(directory)))
        note["streamed"] = ctx.memory.describe()
    elif needs_weights(ctx):
        if ctx.converted is not None:  # converted only when the weights are needed
            converted = ctx.converted.converted_source(source, dtype=ctx.dtype)
            if converted != source:
                note["converted"] = "reused" if copy is not None else "made"
                source = converted
        ctx.model = load_model(source, dtype=ctx.dtype, device=ctx.device)
        hooks.progress("loading", 0.9)
        ctx.tokenizer = load_tokenizer(source)
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


def _optimise(ctx: RunContext, _hooks: Hooks) -> Note:
    from models.run import pipeline
    shutil.rmtree(ctx.run_dir / LAYOUTS_DIR, ignore_errors=True)
    pipeline.stage_layouts(ctx.run_state(), spec=ctx.optimise)
    _restore_layouts(ctx)
    return {"layouts": len(ctx.run_state().layouts)}


def _restore_layouts(ctx: RunContext) -> None:
    """The layouts as saved, in name order (a resumed run reports them as the first did)."""
    from models.layouts.layout import load

    ctx.run_state().layouts = {p.stem: load(p) for p in sorted((ctx.run_dir / LAYOUTS_DIR).glob("*.json"))}


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
    from models.export.resident import dtype_name, export_dtype
    from models.io.loading import DTYPES

    compute = DTYPES[ctx.dtype]
    return {"dtype": dtype_name(export_dtype(ctx.export_dtype, config=ctx.config, compute=compute)),
            "compute_dtype": dtype_name(compute)}


def _export(ctx: RunContext, hooks: Hooks) -> Note:
    from models.export.resident import export_dtype
    from models.io.loading import DTYPES
    from models.run import pipeline

    for sub in EXPORT_DIRS:
        shutil.rmtree(ctx.run_dir / sub, ignore_errors=True)
    # The checkpoint and the shards are written together, tensor by tensor, which reports progress.
    pipeline.stage_export(ctx.run_state(), model=weights_of(ctx), tokenizer=ctx.tokenizer,
                          progress=lambda _name, f: hooks.progress("exporting", f),
                          overwrite=True, checkpoint=ctx.checkpoint, shards=ctx.shards, schedule=ctx.schedule,
                          dtype=export_dtype(ctx.export_dtype, config=ctx.config, compute=DTYPES[ctx.dtype]))
    return {}


def _restore_export(ctx: RunContext) -> None:
    ctx.run_state().export_dtypes = export_dtypes(ctx)


def _distil(ctx: RunContext, hooks: Hooks) -> Note:
    from models import distill
    from models.schedules.grammar import parse_schedule

    plan = ctx.distill
    assert plan is not None
    spec = plan.spec
    if ctx.schedule is not None and not parse_schedule(ctx.schedule).resolvable:
        # spd:auto:K (`spec` says dtp:δ until then): the students run the spd:B the affinity stage chose
        spec = dataclasses.replace(spec, schedule=ctx.run_state().affinity.schedule)
    ctx.distill_summary = distill.run_distill(
        spec, teacher=ctx.model, tokenizer=ctx.tokenizer, out_dir=plan.out_dir, layouts_dir=plan.layouts_dir,
        model_id=ctx.model_id, progress=hooks.progress, should_stop=hooks.should_stop, on_eval=plan.on_eval,
        on_step=plan.on_step, on_run_start=plan.on_run_start, plot=plan.plot,
        keep_checkpoints=plan.keep_checkpoints, abandonable=hooks.abandonable)
    runs = len(spec.layouts) * len(spec.seeds)
    return {"runs": runs, "total_steps": runs * spec.recipe.steps}


# ---- the list ------------------------------------------------------------------------------------------

STAGES: tuple[Stage[RunContext], ...] = (
    Stage("loading", _load, resumable=False),
    Stage("calibration", _calibrate, outputs=(BLOCKS_FILE,), applies=_optimising, restore=_restore_blocks),
    Stage("affinity", _affinity, inputs=(BLOCKS_FILE,), outputs=(AFFINITY_FILE,), applies=_optimising,
          restore=_restore_affinity, checks_stop=True),
    Stage("optimising", _optimise, inputs=(AFFINITY_FILE,), outputs=(LAYOUTS_DIR,), applies=_optimising,
          restore=_restore_layouts),
    Stage("stability", _stabilise, inputs=(BLOCKS_FILE,), outputs=(STABILITY_DIR, STABILITY_FILE),
          applies=_stability, restore=_restore_stability),
    Stage("exporting", _export, inputs=(LAYOUTS_DIR,), outputs=EXPORT_DIRS, applies=_exporting,
          restore=_restore_export),
    Stage("distilling", _distil, inputs=(LAYOUTS_DIR,), outputs=(DISTILL_DIR,), applies=_distilling,
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
REPORT_INPUTS = (AFFINITY_FILE, LAYOUTS_DIR, STABILITY_FILE, *EXPORT_DIRS)


def build_report(ctx: RunContext, *, seconds: dict[str, float] | None = None, calibration_identity: str | None = None,
                 data: dict[str, Any] | None = None) -> dict[str, Any]:
    """report.json of the run (models.run.pipeline.build_report) with the stages' wall seconds."""
    from models.run import pipeline
    state = ctx.run_state()
    state.seconds = dict(seconds or {})
    return pipeline.build_report(state, spec=ctx.optimise, model_name=ctx.model_id, calibration=ctx.calibration_shown,
                                 calibration_identity=calibration_identity, data=data)

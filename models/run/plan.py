"""A run's plan, made once from its job spec: `plan_run(spec, …) -> RunPlan`.

The worker (worker/run.py: job spec → plan) and `dtp-layout optimise` (app/cli/commands/optimise.py: flags →
job spec → plan) both build their run here; `dtp-layout distill` fills a plan of its own (no optimise stages).
The plan holds what the stages run (`stage_names`) and with what: the optimise spec, the calibration (as read and
as given), the export, the distillation's spec, the memory limit, and the schedule parsed once
(`models.schedules.grammar.ScheduleSpec`, from the spec's `schedule` and `delta`). spd:auto:K is the one schedule
the spec cannot fix: the plan records that it is still to be chosen (`schedule_pending`) and the affinity stage,
which chooses its layers, writes the spd:B back (`resolve_schedule`), for the export and the distillation after it.

What the spec asks that the run would refuse is refused here, before any work, by the same rules the API's
submit check asks (models/run/rules.py). Torch-free at import.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from models.affinity.edge_memory import EDGE_MEMORY_LIMIT
from models.run.rules import RunFacts, RunRefused, job_schedule, spec_refusals
from models.run.stage_names import STAGES as STAGE_ORDER
from models.schedules.grammar import ScheduleSpec, dtp_spec, parse_schedule

DataReader = Callable[[str, str], str]  # (source as given, its spec field) -> what models.data.calibration reads


@dataclass(kw_only=True)
class RunPlan:
    """What a run does and with what: every parameter of its stages, from its job spec."""

    model_id: str  # as shown in the report
    dtype: str  # compute dtype
    devices: int
    delta: int  # the layouts' δ
    # The communication schedule (parsed at the boundary: models.run.rules.job_schedule) the layouts are optimised
    # for, the shards exported for and the students simulate. spd:auto:K until the affinity stage chooses its
    # layers (`resolve_schedule`).
    schedule: ScheduleSpec
    optimise: Any = None  # models.run.pipeline.OptimiseSpec; None: no optimise stages (`dtp-layout distill`)
    calibration: Any = None  # models.data.calibration.CalibrationSpec, as read (a server path)
    calibration_shown: Any = None  # the same, as given (recorded in the affinity file and the report)
    checkpoint: bool = False
    shards: bool = False
    export_dtype: str = "auto"
    distill: Any = None  # models.distill.spec.DistillSpec; None: no distillation
    probe: Any = None  # models.probe.spec.ProbeSpec: choose the exported layout by a training probe; None: none
    # the memory limit in bytes (None: none) and whether to stream (None: when the model would not fit under
    # the limit; models.streaming.memory_plan)
    max_memory: int | None = None
    stream: bool | None = None

    # -- what runs --

    @property
    def stage_names(self) -> tuple[str, ...]:
        """The stages this run runs, in order (models.run.stages applies each by this list)."""
        optimising = self.optimise is not None
        # every stage but loading (always) runs when asked
        asked = {"calibration": optimising, "affinity": optimising, "optimising": optimising,
                 "probing": optimising and self.probe is not None,
                 "stability": optimising and bool(self.optimise.stability),
                 "exporting": optimising and (self.checkpoint or self.shards), "distilling": self.distill is not None}
        return tuple(name for name in STAGE_ORDER if asked.get(name, True))

    @property
    def facts(self) -> RunFacts:
        """The run as the refusal rules read it (models/run/rules.py)."""
        optimise, calibration = self.optimise, self.calibration
        return RunFacts(devices=self.devices, delta=self.delta, schedule=self.schedule,
                        optimises=optimise is not None and calibration is not None,
                        stability=optimise is not None and bool(optimise.stability),
                        exports="exporting" in self.stage_names,
                        distills=self.distill is not None or self.probe is not None,  # the probe distils too
                        layout_independent_ok=optimise is None or bool(optimise.layout_independent_ok),
                        dtype=self.dtype, calibration_sequences=calibration.sequences if calibration else 0,
                        calibration_seq_len=calibration.seq_len if calibration else 0,
                        batch_size=optimise.batch_size if optimise is not None else 1,
                        edge_memory_limit=optimise.edge_memory_limit if optimise is not None else EDGE_MEMORY_LIMIT)

    # -- the schedule --

    @property
    def schedule_pending(self) -> bool:
        """spd:auto:K whose layers the affinity stage has not chosen yet."""
        return not self.schedule.resolvable

    def resolve_schedule(self, chosen: str | None) -> None:
        """spd:auto:K's layers, as the affinity stage chose them (the affinity file's schedule): the spd:B the
        export and the distillation run from now on."""
        if not self.schedule_pending or chosen is None:
            return
        spd = parse_schedule(chosen)
        assert spd.kind == "spd" and len(spd.layers) == self.schedule.count, chosen
        self.schedule = spd
        if self.distill is not None:
            self.distill = dataclasses.replace(self.distill, schedule=spd)


def plan_run(spec: Any, *, data: DataReader | None = None, max_memory: int | None = None, stream: bool | None = None,
             layout_independent_ok: bool = True, **optimise_options: Any) -> RunPlan:
    """The run of a validated job spec (app.core.schemas.jobs.JobSpec, or anything with its attributes).

    `data(source, field)`: what each data source is read as (the worker: an upload's copy, a name under the data
    root as its path; the CLI: as given). `max_memory`: the run's limit in bytes, resolved by the caller (the
    worker's default applies to a job without one); `stream`: True to stream whatever the limit.
    `layout_independent_ok`: a job may run tp or ladder to compare them (its layouts then optimise dtp:δ);
    `optimise` refuses them. `optimise_options`: further OptimiseSpec fields (the edges' memory). Raises
    RunRefused (a ValueError naming the field) for what the run would refuse whatever the model."""
    from models.data.calibration import CalibrationSpec
    from models.probe.spec import probe_of
    from models.run.pipeline import OptimiseSpec

    if refusals := spec_refusals(spec):
        raise RunRefused(refusals)
    read = data or (lambda source, _field: source)
    schedule = job_schedule(spec.schedule, spec.delta)  # the job spec's text, parsed once: the run's from here on
    given = spec.calibration.model_dump()
    shown = CalibrationSpec(**given)
    calibration = CalibrationSpec(**{**given, "source": read(spec.calibration.source, "calibration.source")})
    optimise = OptimiseSpec(devices=spec.devices, delta=spec.delta, schedule=schedule, score=spec.score,
                            random_layouts=spec.random_layouts, ablations=spec.ablations,
                            export=spec.export.checkpoint or spec.export.shards, batch_size=spec.batch_size,
                            restarts=spec.restarts, stability=spec.stability,
                            layout_independent_ok=layout_independent_ok, **optimise_options)
    plan = RunPlan(model_id=spec.model.id, dtype=spec.model.dtype, devices=spec.devices, delta=spec.delta,
                   schedule=schedule, optimise=optimise, calibration=calibration, calibration_shown=shown,
                   checkpoint=spec.export.checkpoint, shards=spec.export.shards, export_dtype=spec.export.dtype,
                   max_memory=max_memory, stream=stream, probe=probe_of(spec))
    if spec.distill is not None:
        # spd:auto:K: the students hold dtp:δ until its layers are chosen (`RunPlan.resolve_schedule`)
        plan.distill = distill_spec(spec, calibration=calibration, read=read,
                                    schedule=dtp_spec(spec.delta) if plan.schedule_pending else schedule)
    return plan


def distill_spec(spec: Any, *, calibration: Any, read: DataReader, schedule: ScheduleSpec) -> Any:
    """The job spec's `distill` as a models.distill.spec.DistillSpec, its data sources as read. `schedule`:
    what the students simulate."""
    from models.data.calibration import CalibrationSpec
    from models.distill.recipe import DistillRecipe
    from models.distill.spec import DistillSpec

    d = spec.distill
    data = {part: CalibrationSpec(**{**fields, "source": read(fields["source"], f"distill.{part}.source")})
            for part, fields in zip(("train", "eval"), d.data_specs(spec.calibration), strict=True)}
    return DistillSpec(layouts=tuple(d.layouts), train=data["train"], eval=data["eval"], devices=spec.devices,
                       delta=spec.delta, seeds=tuple(d.seeds), recipe=DistillRecipe.from_dict(d.recipe_fields()),
                       calibration=calibration, allow_overlap=d.allow_overlap, world_size=d.world_size,
                       schedule=schedule)


def plan_distill(distill: Any, *, model_id: str, dtype: str) -> RunPlan:
    """The run of a distillation alone (`dtp-layout distill`: layouts already made, a DistillSpec from its
    flags): no optimise spec, so the stages that apply are loading, then distilling (which resumes every
    run from its checkpoints by itself). The schedule is the DistillSpec's (parsed at the flags)."""
    return RunPlan(model_id=model_id, dtype=dtype, devices=distill.devices, delta=distill.delta,
                   schedule=distill.schedule, distill=distill)

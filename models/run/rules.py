"""Every reason a run refuses a job, declared once: the API's submit check (app/core/services) and the run's
plan and stages (models/run/plan.py, models/run/stages.py) all ask these functions, so that a job the worker
would refuse is refused at submit wherever the API can see it (the model's config readable without weights).

  spec_refusals    the job spec alone: what the stages would refuse whatever the model
  model_refusals   the spec against the model's shape: L, δ and the schedule (the loading stage)
  memory_refusals  the spec under a memory limit: the run fits (streamed if it must), what a streamed model
                   cannot run, and the pass over a schedule's further edges beside the model in memory (the
                   loading stage, before any weight is read)

Each refusal names its rule (`RULES`), the spec field to blame and the exception the run raises for it.
Torch-free: the API process imports this module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from models.affinity.edge_memory import EDGE_MEMORY_LIMIT
from models.base.layout_format import LayoutError
from models.schedules.grammar import ScheduleError, ScheduleSpec, dtp_spec, parse_schedule, schedule_spec

# The rules, by name: what each refuses. tests/app/api/test_refusals.py feeds each a job can meet (all but
# LOCAL_ONLY) to a worker and to the API's submit check, which must refuse it too, naming the same field.
RULES: dict[str, str] = {
    "stability-halves": "stability optimises on each half of the calibration blocks: at least 2 blocks",
    "distill-layouts": "the distilled layouts are ones the job produces, each named once",
    "distill-train-blocks": "the distillation has at least one batch of training blocks",
    "devices": "L divides the model's KV groups and its FFN width",
    "delta": "δ is within the model's layers",
    "schedule-fits": "the schedule's layers, blocks and δ fit the model (spd:auto:K: K ≤ its layers)",
    "layout-independent": "a command that only optimises layouts refuses a schedule no layout matters for",
    "memory-fits": "the run fits its memory limit, streamed layer by layer if it must",
    "streamed-distill": "a distillation holds the whole student and teacher: it cannot stream",
    "streamed-spd-auto": "spd:auto:K chooses its layers by simulating the whole model: it cannot stream",
    "streamed-edges": "the streamed affinity pass scores the paper's chain only: a schedule with further edges "
                      "needs the model in memory",
    "edges-memory": "the pass over a schedule's edges beyond the paper's chain fits the memory limit beside the "
                    "model in memory",
}
LOCAL_ONLY = frozenset({"layout-independent"})  # `optimise` refuses these; a job runs them (to compare schedules)


@dataclass(frozen=True)
class Refusal:
    """One reason a run refuses a job: its rule, the spec field to blame, what to tell, what the run raises."""

    rule: str
    field: str
    message: str
    error: type[Exception] = ValueError

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise KeyError(f"no refusal rule {self.rule!r} (models/run/rules.py RULES)")

    def exception(self) -> Exception:
        return self.error(self.message)


class RunRefused(ValueError):
    """A job the run refuses before its first stage (`refusals`: every reason); the text is the first one's."""

    def __init__(self, refusals: list[Refusal]) -> None:
        super().__init__(refusals[0].message if refusals else "refused")
        self.refusals = refusals


def raise_first(refusals: list[Refusal]) -> None:
    """Raise the first refusal as the exception the run has always raised for it."""
    if refusals:
        raise refusals[0].exception()


# ---- the schedule and δ ------------------------------------------------------------------------------

class DeltaConflict(ScheduleError):
    """A dtp schedule and a different δ given with it."""

    def __init__(self, schedule: ScheduleSpec, delta: int) -> None:
        super().__init__(f"schedule {schedule} and delta={delta} disagree (the schedule's δ is {schedule.delta}): "
                         f"give one of them, or the same δ in both")
        self.schedule, self.delta = schedule, delta


def schedule_and_delta(text: str | None, delta: int | None) -> tuple[ScheduleSpec | None, int | None]:
    """The schedule rule of a job spec and of every command, at the boundary (the spec's `schedule` and `delta`,
    the flags --schedule and --delta): `text` parsed (a ScheduleError names what is accepted); a dtp schedule
    gives δ where `delta` is not given (None) and is refused (DeltaConflict) with a different one. Returns the
    schedule (None where not given) and the δ; `job_schedule` then makes them the one ScheduleSpec the run
    carries."""
    if text is None:
        return None, delta
    spec = parse_schedule(text)
    if spec.kind == "dtp":
        if delta is not None and delta != spec.delta:
            raise DeltaConflict(spec, delta)
        delta = spec.delta
    return spec, delta


def job_schedule(schedule: ScheduleSpec | str | None, delta: int) -> ScheduleSpec:
    """The one schedule a run carries past the boundary: a job spec's or a command's `schedule` (its string,
    parsed here, or already parsed), else dtp:δ of `delta` (the shorthand)."""
    return dtp_spec(delta) if schedule is None else schedule_spec(schedule)


# ---- what a run does, as the rules see it ---------------------------------------------------------------

@dataclass(frozen=True)
class RunFacts:
    """The parts of a run the rules read: from a job spec (`of_spec`) or a run's plan (`RunPlan.facts`)."""

    devices: int
    delta: int  # the layouts' δ (recorded in each; for a dtp schedule, its δ)
    schedule: ScheduleSpec
    optimises: bool = True  # the calibration, affinity and optimising stages run
    stability: bool = False
    exports: bool = False
    distills: bool = False
    # a job may run a schedule no layout matters for (tp, ladder), to compare it; `optimise` refuses it
    layout_independent_ok: bool = True
    dtype: str = "float32"
    calibration_sequences: int = 0
    calibration_seq_len: int = 0
    batch_size: int = 1
    edge_memory_limit: int = EDGE_MEMORY_LIMIT  # what the further edges' pass may keep (OptimiseSpec's)

    @classmethod
    def of_spec(cls, spec: Any, *, layout_independent_ok: bool = True) -> RunFacts:
        """A validated job spec's (app.core.schemas.jobs.JobSpec, or anything with its attributes)."""
        return cls(devices=spec.devices, delta=spec.delta, schedule=job_schedule(spec.schedule, spec.delta),
                   optimises=True,
                   stability=bool(spec.stability), exports=bool(spec.export.checkpoint or spec.export.shards),
                   distills=spec.distill is not None or bool(getattr(spec, "probe", 0)),  # the probe distils
                   layout_independent_ok=layout_independent_ok,
                   dtype=spec.model.dtype, calibration_sequences=spec.calibration.sequences,
                   calibration_seq_len=spec.calibration.seq_len, batch_size=spec.batch_size)

    @property
    def chooses_spd_layers(self) -> bool:
        return not self.schedule.resolvable


# ---- the rules -----------------------------------------------------------------------------------------

def spec_refusals(spec: Any) -> list[Refusal]:
    """What a validated job spec asks that its run would refuse whatever the model (the plan refuses it)."""
    out: list[Refusal] = []
    if spec.stability and spec.calibration.sequences < 2:
        out.append(Refusal("stability-halves", "calibration.sequences",
                           f"stability needs at least 2 calibration blocks (one per half), got "
                           f"{spec.calibration.sequences}"))
    distill = spec.distill
    if distill is None:
        return out
    from models.layouts.names import canonical_layout_name

    produced = spec.layout_names()
    seen: dict[str, str] = {}
    for i, name in enumerate(distill.layouts):
        try:
            canonical = canonical_layout_name(name)  # random:SEED is random-SEED
        except LayoutError as exc:
            out.append(Refusal("distill-layouts", f"distill.layouts.{i}", str(exc)))
            continue
        if canonical not in produced:
            hint = "" if spec.ablations else "; the ablation layouts (anti-optimised, …) need ablations=true"
            out.append(Refusal("distill-layouts", f"distill.layouts.{i}",
                               f"layout {name!r} is not one this job produces (it produces: "
                               f"{', '.join(produced)}{hint})"))
        elif canonical in seen:
            out.append(Refusal("distill-layouts", f"distill.layouts.{i}", f"layout {name!r} is {seen[canonical]!r} "
                                                                          "again"))
        seen.setdefault(canonical, name)
    train, _ = distill.data_specs(spec.calibration)
    batch = distill.effective_recipe()["batch_size"]
    if train["sequences"] < batch:
        out.append(Refusal("distill-train-blocks", "distill.train.sequences",
                           f"{train['sequences']} training blocks are fewer than one batch "
                           f"(recipe.batch_size={batch})"))
    return out


def model_refusals(facts: RunFacts, shape: Any) -> list[Refusal]:
    """L, δ and the schedule against the model's shape (models.families.model_shape): what the loading stage
    refuses from the config, before any weight is read."""
    from models.layouts.layout import check_delta, check_devices
    from models.schedules.grammar import check_schedule

    out: list[Refusal] = []
    for rule, check, value in (("devices", check_devices, facts.devices), ("delta", check_delta, facts.delta)):
        try:
            check(shape, value)
        except LayoutError as exc:
            out.append(Refusal(rule, rule, str(exc), LayoutError))
    if out:
        return out
    try:  # its layers, blocks and δ against the model's depth; spd:auto:K: K now, its layers at the affinity stage
        check_schedule(facts.schedule, shape.num_layers, facts.devices)
    except ScheduleError as exc:
        return [Refusal("schedule-fits", "schedule", str(exc), ScheduleError)]
    if facts.optimises and not facts.layout_independent_ok and facts.schedule.resolvable:
        from models.variants.set import objective_schedule

        try:
            objective_schedule(facts.schedule, num_layers=shape.num_layers, devices=facts.devices)
        except ScheduleError as exc:
            out.append(Refusal("schedule-fits", "schedule", str(exc), ScheduleError))
        except LayoutError as exc:
            out.append(Refusal("layout-independent", "schedule", str(exc), LayoutError))
    return out


def _streamed(why: str) -> str:
    return (f"the model is streamed layer by layer to fit max_memory, and {why}: give a larger max_memory (or none), "
            f"or a schedule of the chain (dtp:1, spd:B)")


def run_further_pairs(facts: RunFacts, num_layers: int) -> list[tuple[int, int]]:
    """The edges beyond the paper's chain that the affinity pass of this run scores (which only the in-memory
    pass does): those of J_σ of its objective schedule."""
    from models.affinity.edge_memory import further_pairs
    from models.variants.set import objective_schedule

    if facts.chooses_spd_layers:
        return []  # spd:B: one up edge per dropped layer, all on the chain
    try:
        objective = objective_schedule(facts.schedule, num_layers=num_layers, devices=facts.devices)
    except LayoutError:  # a layout-independent schedule: its layouts optimise the chain
        return []
    return [] if objective is None else further_pairs(objective, num_layers)


def edges_memory(facts: RunFacts, config: Any, plan: Any) -> Refusal | None:
    """The in-memory run's pass over its schedule's further edges (models.affinity.edge_memory) beside the model
    and its micro-batch (`plan`, in memory) against the plan's limit: a refusal naming the need, its largest part
    and what fits; None when it fits, or no limit or no further edge."""
    from models.affinity.edge_memory import edge_pass_memory
    from models.families import model_shape
    from models.io.sizes import format_size
    from models.streaming.memory_plan import MemoryLimitError

    if plan.limit is None:
        return None
    shape = model_shape(config)
    edges = edge_pass_memory(run_further_pairs(facts, shape.num_layers), shape, facts.edge_memory_limit)
    if edges is None or plan.in_memory + edges.peak <= plan.limit:
        return None
    need = plan.in_memory + edges.peak
    return Refusal("edges-memory", "schedule", (
        f"schedule {facts.schedule} scores edges beyond the paper's chain beside the model in memory, and needs "
        f"about {format_size(need)}: the model in memory {format_size(plan.in_memory)} + the edge pass "
        f"{format_size(edges.peak)} ({edges.describe()}), whose largest part is {edges.largest_text()}; the "
        f"memory limit (max_memory) is {format_size(plan.limit)}. A schedule on the paper's chain (dtp:1 or "
        f"dtp:1@K) needs no such edge; or give a max_memory of at least {format_size(need)}"), MemoryLimitError)


def memory_refusals(facts: RunFacts, config: Any, *, limit: int | None, stream: bool | None = None,
                    affinity_pass: bool = True) -> tuple[Any, list[Refusal]]:
    """The run under its memory limit (models.streaming.memory_plan): its plan (None when it cannot fit even
    streamed) and every refusal. `affinity_pass`: whether an affinity pass is still to run (a streamed one
    cannot choose spd:auto's layers nor score further edges; an in-memory one scores them beside the model)."""
    from models.families import model_shape
    from models.streaming.memory_plan import MemoryLimitError, plan_memory

    tokens = batch_tokens = 0
    if facts.optimises:
        tokens = facts.calibration_sequences * facts.calibration_seq_len
        batch_tokens = min(facts.calibration_sequences, facts.batch_size) * facts.calibration_seq_len
    try:
        plan = plan_memory(config, dtype=facts.dtype, command="optimise", limit=limit, tokens=tokens,
                           batch_tokens=batch_tokens, export=facts.optimises and facts.exports, stream=stream)
    except MemoryLimitError as exc:
        return None, [Refusal("memory-fits", "max_memory", str(exc), MemoryLimitError)]
    out: list[Refusal] = []
    if not plan.stream:
        if facts.optimises and affinity_pass and (refusal := edges_memory(facts, config, plan)) is not None:
            out.append(refusal)
        return plan, out
    if facts.distills:
        out.append(Refusal("streamed-distill", "max_memory",
                           "distillation holds the whole student and teacher and does not stream: "
                           f"{plan.describe()}; raise max_memory or run the distillation without it", MemoryLimitError))
    if facts.optimises and affinity_pass and facts.chooses_spd_layers:
        out.append(Refusal("streamed-spd-auto", "schedule",
                           _streamed(f"{facts.schedule} chooses its layers by simulating the whole model"),
                           MemoryLimitError))
    elif facts.optimises and affinity_pass and run_further_pairs(facts, model_shape(config).num_layers):
        out.append(Refusal("streamed-edges", "schedule",
                           _streamed(f"schedule {facts.schedule} needs edges beyond the paper's chain, which only the "
                                     f"in-memory affinity pass scores"), MemoryLimitError))
    return plan, out

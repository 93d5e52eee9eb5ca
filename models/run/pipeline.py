"""The work of the optimise run's stages: calibration → affinity pass → layouts (→ stability) → export.

Each stage is its own function over a run directory; `models.run.stages` declares them as the stage list
that `models.run.runner` runs in order, resumably, for the CLI and the worker alike.
"""

from __future__ import annotations

import json
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers

from models.affinity.edge_memory import EDGE_MEMORY_LIMIT
from models.affinity.edges import KEPT_MASS, schedule_affinity_pass
from models.affinity.names import SCORES
from models.affinity.scoring import AffinityResult
from models.base.layout_format import LayoutError
from models.base.progress import Progress, ShouldStop
from models.data.calibration import CONVERGED_CALIBRATION_TOKENS, CalibrationSpec, DataError, load_blocks
from models.data.heldout import source_identity
from models.evaluation.spd_auto import resolve_spd_auto
from models.export.files import dtype_name
from models.export.writer import export_layout
from models.families import model_shape
from models.io.assets import AssetNotFoundError
from models.io.atomic import atomic_write_json
from models.layouts.layout import Layout
from models.optimise.edges import schedule_pairs
from models.run.files import AFFINITY_FILE, REPORT_FILE
from models.schedules.grammar import Schedule, ScheduleSpec, dtp_spec
from models.streaming.source import layer_source
from models.variants.score import edge_kept_mass
from models.variants.set import PAPER_RESTARTS, ablation_names, build_layouts, objective_schedule, optimises_chain
from models.variants.stability import HALVES, half_layouts, stability_report

# The paper's seven spread layouts (§5.4) for an FO run; models.variants.set defines them.
ABLATIONS = tuple(ablation_names("fo"))


@dataclass(frozen=True, kw_only=True)
class OptimiseSpec:
    devices: int
    # The communication schedule the run is for, parsed at the boundary (the job spec's `schedule` and `delta`,
    # the flags: models.run.rules.job_schedule): the layouts optimise its J_σ (issue 20; dtp:0 and dtp:1 the
    # paper's chain objective, `models.variants.set.optimises_chain`), the shards are exported for it.
    schedule: ScheduleSpec
    delta: int = 1  # the layouts' δ (recorded in each; a dtp schedule's own δ)
    score: str = "fo"
    random_layouts: int = 0
    ablations: bool = False
    export: bool = True
    batch_size: int = 4
    restarts: int = 4  # the paper's procedure is 0 (one start, from the contiguous KV groups)
    stability: bool = False  # also optimise on each half of the calibration blocks (models.variants.stability)
    edge_memory_limit: int = EDGE_MEMORY_LIMIT  # bytes of dense further-edge matrices before neuron→neuron go sparse
    edge_kept_mass: float = KEPT_MASS  # the mass a sparse neuron→neuron edge keeps (within the limit)
    # A job may run a layout-independent schedule (tp, ladder: a_n = b_n everywhere) to compare it with
    # the others; its layouts then optimise the paper's dtp:δ objective (they cannot matter), where the
    # `optimise` command refuses such a schedule outright.
    layout_independent_ok: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.schedule, ScheduleSpec):
            raise TypeError(f"schedule must be a ScheduleSpec (models.run.rules.job_schedule parses a spec's), got "
                            f"{type(self.schedule).__name__}")
        if not 0 < self.edge_kept_mass <= 1 or self.edge_memory_limit < 0:
            raise ValueError(f"edge_kept_mass must be in (0, 1] and edge_memory_limit ≥ 0, got "
                             f"{self.edge_kept_mass}, {self.edge_memory_limit}")
        if self.score not in SCORES:
            raise ValueError(f"score must be one of {', '.join(SCORES)}, got {self.score!r}")
        if self.random_layouts < 0:
            raise ValueError(f"random_layouts must be ≥ 0, got {self.random_layouts}")
        if self.restarts < 0:
            raise ValueError(f"restarts must be ≥ 0, got {self.restarts}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be ≥ 1, got {self.batch_size}")


    def objective_schedule(self, num_layers: int, resolved: str | None = None) -> Schedule | None:
        """The schedule the layouts are optimised for (`models.variants.set.objective_schedule`); `resolved`:
        the spd:B an spd:auto:K became (the affinity file's schedule)."""
        try:
            return objective_schedule(self.schedule, num_layers=num_layers, devices=self.devices, resolved=resolved)
        except LayoutError:
            if self.layout_independent_ok:
                return None
            raise

    @property
    def chooses_spd_layers(self) -> bool:
        """spd:auto:K: the affinity stage first measures each layer's sensitivity and picks K layers."""
        return self.schedule.kind == "spd-auto"


@dataclass
class RunState:
    """What the stages produce, plus per-stage wall seconds."""

    out_dir: Path
    seconds: dict[str, float] = field(default_factory=dict)
    blocks: torch.Tensor | None = None
    affinity: AffinityResult | None = None
    layouts: dict[str, Layout] = field(default_factory=dict)
    export_dtypes: dict[str, str] | None = None  # what stage_export stored and what the passes computed in
    stability: dict[str, Any] | None = None
    probe: dict[str, Any] | None = None  # the training probe's probe.json (models.probe.probe)
    chosen: Layout | None = None  # the probe's pick: the layout exported in place of `optimised`

    def timed(self, stage: str, start: float) -> None:
        self.seconds[stage] = round(self.seconds.get(stage, 0.0) + time.perf_counter() - start, 3)


def run_affinity(model: Any, blocks: torch.Tensor, *, schedule: Schedule | None, spec: OptimiseSpec,
                 spill_dir: Path | None = None, **kw: Any) -> AffinityResult:
    """The affinity pass of `schedule`'s objective (None: the paper's chain) over a loaded model, or
    streamed layer by layer over a `StreamedModel` (the same pass, fed by `models.streaming.source`). A
    streamed model scores the chain's edges only: a schedule that needs further edges (KV→KV,
    neuron→neuron, …) is refused there, naming what would run it."""
    return schedule_affinity_pass(model, blocks, schedule=schedule, batch_size=spec.batch_size,
                                  edge_memory_limit=spec.edge_memory_limit, edge_kept_mass=spec.edge_kept_mass,
                                  spill_dir=spill_dir, **kw)


def _spill_dir(model: Any, state: RunState) -> Path | None:
    """Where a streamed pass spills its hidden states when its plan says so: the run directory."""
    plan = layer_source(model).memory_plan
    return state.out_dir if plan is not None and plan.spill else None


def stage_calibration(state: RunState, *, model: Any, tokenizer: Any, calibration: CalibrationSpec) -> None:
    t0 = time.perf_counter()
    state.blocks = load_blocks(calibration, tokenizer, vocab_size=model.config.vocab_size)
    state.timed("calibration", t0)


def stage_affinity(state: RunState, *, model: Any, spec: OptimiseSpec, model_name: str,
                   calibration: CalibrationSpec, progress: Progress | None = None,
                   should_stop: ShouldStop | None = None) -> None:
    t0 = time.perf_counter()
    assert state.blocks is not None, "stage_calibration first"
    meta = {"model": model_name, "calibration": json.dumps(asdict(calibration)),
            "calibration_fingerprint": calibration.fingerprint(), "dtype": str(layer_source(model).dtype)}
    resolved = None
    if spec.chooses_spd_layers:  # spd:auto:K, spd:isolated:K: chosen here
        whole = layer_source(model).whole_model(f"{spec.schedule} chooses its layers by simulating the whole model")
        chosen, sensitivities, rounds = resolve_spd_auto(spec.schedule, whole, state.blocks,
                                                         devices=spec.devices, batch_size=spec.batch_size,
                                                         progress=progress)
        resolved = str(chosen)
        meta["spd_sensitivities"] = json.dumps(sensitivities)
        meta["spd_auto"] = str(spec.schedule)
        if rounds:  # the cumulative rule's rounds: {layer: KL with the layers chosen before also dropped}
            meta["spd_rounds"] = json.dumps([{str(i): kl for i, kl in r.items()} for r in rounds])
    schedule = spec.objective_schedule(model_shape(model.config).num_layers, resolved)
    state.affinity = run_affinity(model, state.blocks, schedule=schedule, spec=spec, progress=progress,
                                  should_stop=should_stop, metadata=meta, spill_dir=_spill_dir(model, state))
    state.affinity.save(state.out_dir / AFFINITY_FILE)
    state.timed("affinity", t0)


def stage_layouts(state: RunState, *, spec: OptimiseSpec, progress: Progress | None = None) -> None:
    """The layouts of `spec` from the affinity; progress("optimising", f) after every sweep and layout scored."""
    t0 = time.perf_counter()
    assert state.affinity is not None, "stage_affinity first"
    state.layouts = build_layouts(state.affinity, devices=spec.devices, delta=spec.delta, score_name=spec.score,
                                  random_layouts=spec.random_layouts, ablations=spec.ablations,
                                  restarts=spec.restarts,
                                  schedule=spec.objective_schedule(state.affinity.shape.num_layers,
                                                                   state.affinity.schedule),
                                  progress=None if progress is None else lambda f: progress("optimising", f))
    for name, lay in state.layouts.items():
        lay.save(state.out_dir / "layouts" / f"{name}.json")
    state.timed("optimise", t0)


def stage_stability(state: RunState, *, model: Any, spec: OptimiseSpec, progress: Progress | None = None,
                    should_stop: ShouldStop | None = None) -> None:
    """Affinity pass and optimiser on each half of the calibration blocks; the report in state.stability."""
    t0 = time.perf_counter()
    assert state.blocks is not None, "stage_calibration first"
    count = len(state.blocks)
    if count < 2:
        raise ValueError(f"stability needs at least 2 calibration blocks (one per half), got {count}")
    parts = dict(zip(HALVES, (state.blocks[:count // 2], state.blocks[count // 2:]), strict=True))
    schedule = spec.objective_schedule(model_shape(model.config).num_layers,
                                       state.affinity.schedule if state.affinity is not None else None)
    halves = {}
    for k, (half, blocks) in enumerate(parts.items()):
        def half_progress(stage: str, fraction: float, k: int = k) -> None:
            if progress:
                progress("stability", (k + fraction) / 2)

        halves[half] = run_affinity(model, blocks, schedule=schedule, spec=spec, progress=half_progress,
                                    should_stop=should_stop, spill_dir=_spill_dir(model, state))
    layouts = half_layouts(halves, devices=spec.devices, delta=spec.delta, score_name=spec.score,
                           restarts=spec.restarts, schedule=schedule)
    for lay in layouts.values():
        lay.save(state.out_dir / "stability" / f"{lay.name}.json")
    state.stability = stability_report(halves, layouts, score_name=spec.score, restarts=spec.restarts,
                                       blocks={half: len(b) for half, b in parts.items()}, schedule=schedule)
    state.timed("stability", t0)


def stage_export(state: RunState, *, model: Any, tokenizer: Any, progress: Progress | None = None,
                 overwrite: bool = False, checkpoint: bool = True, shards: bool = True,
                 dtype: torch.dtype | None = None, schedule: ScheduleSpec | None = None) -> None:
    """The optimised layout's permuted checkpoint (`checkpoint/`) and/or rank shards (`shards/`), stored
    in `dtype` (see `models.export.files.export_dtype`; None: the dtype the model was loaded in); the shards
    are made for `schedule`, resolved (spd:auto:K already its spd:B: `models.run.stages` passes the plan's;
    None: the layout's own, `models.export.writer.export_layout`)."""
    t0 = time.perf_counter()
    best = state.chosen if state.chosen is not None else state.layouts["optimised"]
    source = layer_source(model)  # tensor by tensor, from memory or from the safetensors: the same tensors
    compute = source.dtype
    export_layout(source, best, checkpoint_dir=state.out_dir / "checkpoint" if checkpoint else None,
                  shards_dir=state.out_dir / "shards" if shards else None, dtype=dtype or compute,
                  tokenizer=tokenizer, overwrite=overwrite, progress=progress, schedule=schedule,
                  compute_dtype=compute)
    state.export_dtypes = {"dtype": dtype_name(dtype or compute), "compute_dtype": dtype_name(compute)}
    state.timed("export", t0)


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    try:
        own = version("dtp-layout")
    except PackageNotFoundError:
        own = "unknown"
    return {"dtp-layout": own, "torch": torch.__version__, "transformers": transformers.__version__,
            "numpy": np.__version__, "python": platform.python_version()}


def build_report(state: RunState, *, spec: OptimiseSpec, model_name: str, calibration: CalibrationSpec,
                 calibration_identity: str | None = None, data: dict[str, Any] | None = None) -> dict:
    """report.json. calibration_identity: which text the calibration read (`models.data.heldout`), so that a
    later `distill --from` holds its blocks out whatever the source is called there; computed from
    calibration.source when not given. data: the held-out placement of a distillation that followed."""
    assert state.affinity is not None
    if calibration_identity is None:
        try:
            calibration_identity = source_identity(calibration.source, calibration.text_field)
        except (DataError, AssetNotFoundError):
            calibration_identity = None
    reports = {name: lay.score for name, lay in state.layouts.items()}
    any_report = next(iter(reports.values())) or {}
    notes = []
    if state.affinity.tokens < CONVERGED_CALIBRATION_TOKENS:
        notes.append(f"calibrated on {state.affinity.tokens} tokens, below the {CONVERGED_CALIBRATION_TOKENS} at which "
                     f"held-out J of the optimised layout stopped improving on SmolLM2-135M (docs/method.md): the "
                     f"layout may miss heavy edges that more calibration text would show")
    if spec.restarts != PAPER_RESTARTS:
        notes.append(f"restarts={spec.restarts}: besides the paper's single start from the contiguous KV groups, "
                     f"the optimiser also started from {spec.restarts} random head assignments and kept the best; "
                     f"pass restarts={PAPER_RESTARTS} for the paper's procedure")
    if spec.ablations and spec.restarts != PAPER_RESTARTS:
        notes.append("neurons-only never moves the KV groups, so restarts cannot change it: compare it with "
                     "optimised-restarts-0 (equal restarts), not with optimised")
    objective = spec.objective_schedule(state.affinity.shape.num_layers, state.affinity.schedule)
    spd = state.affinity.metadata.get("spd_sensitivities")
    spd_rounds = state.affinity.metadata.get("spd_rounds")
    if spd is not None and spd_rounds is not None:
        notes.append(f"{state.affinity.metadata.get('spd_auto')} chose {objective}: cumulatively, each round the "
                     f"layer whose dropped attention sync, with the layers chosen before also dropped, costs least "
                     f"KL(dense ‖ spd:B) on the calibration blocks (spd_rounds; spd_sensitivities: the first "
                     f"round, each layer alone; nats per token, contiguous layout)")
    elif spd is not None:
        notes.append(f"{state.affinity.metadata.get('spd_auto')} chose {objective}: the layers whose dropped "
                     f"attention sync alone costs least KL(dense ‖ spd:i) on the calibration blocks "
                     f"(spd_sensitivities, nats per token, contiguous layout)")
    if objective is None and not optimises_chain(spec.schedule) and spec.layout_independent_ok:
        notes.append(f"schedule={spec.schedule}: every module's partial reaches every device before the next "
                     f"module reads it, so the model is the same under every layout; the layouts optimise the "
                     f"{dtp_spec(spec.delta)} objective (the layout's own δ) and do not matter for this schedule")
    elif objective is None and spec.delta != 1:
        notes.append(f"delta={spec.delta}: the layouts optimise the dtp:1 objective (the paper's chain); at δ=0 "
                     "every module is exchanged before the next one reads it, so no layout is better than another")
    elif objective is not None:
        notes.append(f"the layouts optimise J_σ of schedule {objective}: the co-located affinity of its "
                     f"{len(schedule_pairs(objective))} edges, each weighted by its first-order damage over the "
                     f"paper's edge into the same module (docs/schedules_objective.md)")
        kept = edge_kept_mass(state.affinity, spec.score)
        if kept:
            notes.append(f"{len(kept['edges'])} neuron→neuron edges kept sparse, their largest entries up to "
                         f"{spec.edge_kept_mass:.0%} of their mass within {spec.edge_memory_limit} bytes "
                         f"(dense would exceed it); kept mass {kept['min']:.3f}..{kept['max']:.3f} "
                         f"(median {kept['median']:.3f})")
    return {
        "format": "dtp-layout-report/1",
        "model": model_name,
        "shape": asdict(state.affinity.shape),
        "devices": spec.devices,
        "delta": spec.delta,
        # the schedule the run is for: the one whose J_σ the layouts optimise, else the layout's dtp:δ
        "schedule": str(objective) if objective is not None else str(spec.schedule),
        **({"spd_sensitivities": json.loads(spd)} if spd is not None else {}),
        **({"spd_rounds": json.loads(spd_rounds)} if spd_rounds is not None else {}),
        "score": spec.score,
        "restarts": spec.restarts,
        "paper_procedure": spec.restarts == PAPER_RESTARTS,
        "calibration": asdict(calibration),
        "calibration_fingerprint": calibration.fingerprint(),
        "calibration_identity": calibration_identity,
        "tokens": state.affinity.tokens,
        "random_expectation": any_report.get("random_expectation"),
        "upper_bound": any_report.get("upper_bound"),
        "upper_bound_exact": any_report.get("upper_bound_exact"),
        "layouts": reports,
        # the mass the sparse neuron→neuron edges kept (null: every edge dense, or the chain only)
        "kept_mass": edge_kept_mass(state.affinity, spec.score) if objective is not None else None,
        **({"stability": state.stability} if state.stability is not None else {}),
        # the probe's candidates, their curves and its pick, which the export used (null: no probe)
        **({"probe": state.probe, "chosen_layout": state.probe["chosen"]} if state.probe is not None else {}),
        "seconds": state.seconds,
        "versions": versions(),
        "notes": notes,
        **({"export": state.export_dtypes} if state.export_dtypes else {}),
        **({"data": data} if data is not None else {}),
    }


def write_report(state: RunState, report: dict) -> Path:
    return atomic_write_json(state.out_dir / REPORT_FILE, report)


def summary_table(report: dict) -> str:
    rows = [f"{'layout':<16}{'J':>9}{'J/bound':>9}{'mean up':>9}{'mean down':>11}"]
    bound = report.get("upper_bound") or float("nan")
    for name, rep in sorted(report["layouts"].items(), key=lambda kv: -kv[1]["J"]):
        # a schedule's report has null fractions where it lacks that chain edge: the mean of those it has
        up = [f for f in rep["up_fraction"] if f is not None]
        down = [f for f in rep["down_fraction"] if f is not None]
        rows.append(f"{name:<16}{rep['J']:>9.3f}{rep['J'] / bound:>9.3f}"
                    f"{(np.mean(up) if up else float('nan')):>9.3f}"
                    f"{(np.mean(down) if down else float('nan')):>11.3f}")
    expectation = ("random expectation" if report.get("schedule") else "random expectation (2N-1)/L")
    if report.get("schedule"):
        rows.append(f"J_σ of schedule {report['schedule']}")
    rows.append(f"{expectation} = {report['random_expectation']:.3f}; upper bound = {bound:.3f}"
                f"{'' if report.get('upper_bound_exact') else ' (relaxed)'}; {report['tokens']} calibration tokens")
    return "\n".join(rows)



def stability_text(stability: dict) -> str:
    """The calibration-stability report as a few lines (J of each half's layout on each half)."""
    j, agree = stability["J"], stability["agreement"]
    lines = [f"calibration stability ({stability['score'].upper()} units, restarts {stability['restarts']}):"]
    for on in ("first", "second"):
        half = stability["halves"][on]
        other = "second" if on == "first" else "first"
        lines.append(f"  on the {on} half ({half['blocks']} blocks): own layout J={j[f'{on}_on_{on}']:.3f}, "
                     f"the {other} half's layout J={j[f'{other}_on_{on}']:.3f} "
                     f"({stability['transfer'][on]:.1%}; random {half['random_expectation']:.3f}, "
                     f"bound {half['upper_bound']:.3f})")
    lines.append(f"  neurons on the same device under the best relabelling: {agree['neurons']:.1%} "
                 f"(KV groups {agree['kv_groups']:.1%}; chance about {agree['chance']:.1%})")
    return "\n".join(lines)

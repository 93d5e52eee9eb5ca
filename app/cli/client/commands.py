"""`dtp-layout client …`: the layout service from scripts and CI (submit, status, wait, cancel, list,
download, scores, delete; upload, uploads, delete-upload, usage). Talks HTTP only (app/client/http.py,
app/client/uploads.py); nothing here imports torch.

Exit status (docs/ci.md has the table, command by job state): 0 done (the job succeeded, the gate
passed, every file verified); 1 the job failed or was cancelled, the scores gate failed, or a
downloaded file's sha256 did not match; 2 the service is unreachable or refused the request (bad key,
unknown job, invalid spec) or the command line is wrong; 3 the job has not finished (queued or running:
`download` and `scores --job` of such a job, or a `wait --timeout` that ran out).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from app.cli.args.spec_flags import add_spec_flags, spec_values, with_data_sources, with_flags
from app.cli.client.output import (
    EXIT_ERROR,
    EXIT_FAILED,
    EXIT_NOT_FINISHED,
    Follower,
    client_for,
    distill_lines,
    err,
    job_state,
    out,
    print_json,
    schedule_of,
    status_text,
)
from app.cli.client.scores import cmd_scores
from app.core.jobstate import STATUSES
from models.affinity.names import SCORES
from models.schedules.grammar import ACCEPTED

# ---- submit ----------------------------------------------------------------------------------------

def build_spec(args: argparse.Namespace) -> dict[str, Any]:
    """The job spec: the JSON file (if any), then the flags on top (each flag sets its field's path; a
    field under a block the spec sets to false, `export: false`, stays out); a training or evaluation block
    the flags made without a source gets the one the spec's rules default to."""
    spec: dict[str, Any] = {}
    if args.spec:
        from app.client.http import ClientError

        try:
            text = sys.stdin.read() if args.spec == "-" else Path(args.spec).read_text()
            spec = json.loads(text)
        except (OSError, ValueError) as exc:
            raise ClientError(f"cannot read the job spec {args.spec}: {exc}") from exc
        if not isinstance(spec, dict):
            raise ClientError(f"the job spec {args.spec} must be a JSON object")
    return with_data_sources(with_flags(spec, spec_values(args, "submit")))


def cmd_submit(args: argparse.Namespace) -> int:
    spec = build_spec(args)
    with client_for(args) as client:
        job = client.submit(spec)
        out(json.dumps(job, indent=1) if args.json and not args.wait else job["id"])
        if not args.wait:
            return 0
        return _follow(client, job["id"], args)


# ---- status / wait / cancel / list -----------------------------------------------------------------


def _answer(args: argparse.Namespace, ask: Callable[[Any], Any], show: Callable[[Any], None]) -> int:
    """One request; its answer printed as JSON with --json, else as `show` writes it."""
    with client_for(args) as client:
        answer = ask(client)
    if args.json:
        print_json(answer)
    else:
        show(answer)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    if args.json:
        return _answer(args, lambda client: client.job(args.job), print_json)
    with client_for(args) as client:
        job = client.job(args.job)
        # the distillation's headline is in its metrics, once the distilling stage published summary.json
        distilled = "distilling" in (job.get("stages_done") or [])
        lines = distill_lines(client.metrics(job["id"]).get("summary")) if distilled else []
    out("\n".join([status_text(job), *lines]))
    return 0



def _follow(client: Any, job_id: str, args: argparse.Namespace) -> int:
    from app.client.http import WaitTimeout

    follower = Follower(client.url)
    try:
        job = client.wait(job_id, timeout=args.timeout, interval=args.interval, on_update=follower,
                          on_unreachable=follower.unreachable)
    except WaitTimeout as exc:
        follower.close()
        err(f"dtp-layout client: {exc}")
        return EXIT_NOT_FINISHED
    finally:  # the service gone for good (ClientError) too: the progress bar is closed before the message
        follower.close()
    if args.json:
        print_json(job)
    err(f"job {job_id}: {job_state(job)}")
    return 0 if job["status"] == "succeeded" else EXIT_FAILED


def cmd_wait(args: argparse.Namespace) -> int:
    with client_for(args) as client:
        return _follow(client, args.job, args)


def cmd_cancel(args: argparse.Namespace) -> int:
    with client_for(args) as client:
        job = client.cancel(args.job)
    out(f"job {job['id']}: " + ("cancelled" if job["status"] == "cancelled" else
                                 f"cancel requested (still {job['status']} {job.get('stage') or ''}; it stops at the "
                                 "next micro-batch or step)".replace("  ", " ")))
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    return _answer(args, lambda client: client.jobs(status=args.status, model=args.model, devices=args.devices,
                                                    delta=args.delta, schedule=args.schedule, owner=args.owner,
                                                    limit=args.limit), _show_jobs)


def _show_jobs(jobs: list[dict[str, Any]]) -> None:
    if not jobs:
        err("no jobs")
        return
    out(f"{'id':<33}{'status':<11}{'stage':<24}{'model':<28}{'L':>3}  {'schedule':<12}{'J opt':>9}  created")
    for job in jobs:
        spec = job.get("spec") or {}
        state = job_state(job).split(" ", 1)[1] if job["status"] == "running" else ""
        opt = ((job.get("summary") or {}).get("layouts") or {}).get("optimised")
        model = str((spec.get("model") or {}).get("id"))
        schedule = schedule_of(job)
        schedule = schedule if len(schedule) <= 11 else schedule[:10] + "…"  # a long spd:B list
        out(f"{job['id']:<33}{job['status']:<11}{state[:23]:<24}{model[:27]:<28}{spec.get('devices', ''):>3}  "
             f"{schedule:<12}{'' if opt is None else f'{opt:.3f}':>9}  {job.get('created_at', '')[:19]}")


# ---- download --------------------------------------------------------------------------------------

def cmd_download(args: argparse.Namespace) -> int:
    from app.client.http import DigestMismatch

    out = Path(args.out)
    bar: Any = None

    def on_total(total: int, have: int) -> None:
        nonlocal bar
        from tqdm import tqdm

        bar = tqdm(total=total, initial=have, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
                   desc="download", disable=None, leave=False)

    def on_bytes(n: int) -> None:
        if bar is not None:
            bar.update(n)

    def on_discard(name: str, part: Path, size: int, why: str) -> None:
        err(f"dtp-layout client download: {name}: discarded {size} bytes of {part}: {why}")

    with client_for(args) as client:
        try:
            results = client.download(args.job, out, args.names, on_total=on_total, on_bytes=on_bytes,
                                      on_discard=on_discard)
        except DigestMismatch as exc:
            if bar is not None:
                bar.close()
            for problem in exc.problems:
                err(f"dtp-layout client download: {problem}")
            return EXIT_FAILED
        finally:
            if bar is not None:
                bar.close()
    fetched = sum(r.fetched for r in results)
    resumed = [r for r in results if r.resumed_from]
    kept = [r for r in results if not r.fetched]
    err(f"{len(results)} files in {out} ({sum(r.size for r in results)} bytes, every sha256 verified): "
         f"{fetched} bytes fetched" + (f", {len(resumed)} resumed" if resumed else "")
         + (f", {len(kept)} already complete" if kept else ""))
    if args.json:
        print_json([{"name": r.name, "path": str(r.path), "size": r.size, "sha256": r.sha256, "fetched": r.fetched,
                      "resumed_from": r.resumed_from} for r in results])
    return 0


# ---- uploads, deleting, usage -----------------------------------------------------------------------

def cmd_upload(args: argparse.Namespace) -> int:
    from app.client.uploads import UploadMismatch, upload_path

    bar: Any = None

    def on_total(total: int, have: int) -> None:
        nonlocal bar
        from tqdm import tqdm

        if have:
            err(f"resuming: {have} of {total} bytes are already on the service")
        bar = tqdm(total=total, initial=have, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
                   desc="upload", disable=None, leave=False)

    def on_bytes(n: int) -> None:
        if bar is not None:
            bar.update(n)

    def on_skip(name: str) -> None:
        err(f"dtp-layout client upload: skipped {name} (hidden, or not a plain file)")

    try:
        with client_for(args) as client:
            done = upload_path(client, Path(args.path), name=args.name, kind=args.kind, on_total=on_total,
                               on_bytes=on_bytes, on_skip=on_skip)
    except UploadMismatch as exc:
        err(f"dtp-layout client upload: {exc}")
        return EXIT_FAILED
    finally:
        if bar is not None:
            bar.close()
    if args.json:
        print_json(done)
    else:
        out(done["id"])
        err(f"{done['kind']} upload {done['name']!r} complete ({done['size']} bytes, every sha256 verified); "
             f"name it in a job as {done['ref']}")
    return 0


def cmd_uploads(args: argparse.Namespace) -> int:
    return _answer(args, lambda client: client.uploads(), _show_uploads)


def _show_uploads(items: list[dict[str, Any]]) -> None:
    if not items:
        err("no uploads")
        return
    out(f"{'id':<33}{'kind':<7}{'status':<10}{'bytes':>14}  {'name':<30}created")
    for u in items:
        out(f"{u['id']:<33}{u['kind']:<7}{u['status']:<10}{u['size']:>14}  {u['name'][:29]:<30}"
             f"{u['created_at'][:19]}")


def cmd_delete_upload(args: argparse.Namespace) -> int:
    with client_for(args) as client:
        client.delete_upload(args.upload)
    err(f"upload {args.upload} deleted")
    return 0


def cmd_delete(args: argparse.Namespace) -> int:
    from app.client.http import ClientError

    with client_for(args) as client:
        try:
            job = client.delete_job(args.job)
        except ClientError as exc:
            if exc.status != 409:  # 409: queued or running; the way out is this CLI's command, not the API's route
                raise
            said = str(exc).replace(f"POST /v1/jobs/{args.job}/cancel", f"dtp-layout client cancel {args.job}")
            raise ClientError(said if said != str(exc) else f"{said}; cancel it first: dtp-layout client cancel "
                                                            f"{args.job}", exc.status) from exc
    err(f"job {job['id']}: artifacts removed (the job, its layouts and scores stay)")
    if args.json:
        print_json(job)
    return 0


def cmd_usage(args: argparse.Namespace) -> int:
    return _answer(args, lambda client: client.usage(), _show_usage)


def _show_usage(usage: dict[str, Any]) -> None:
    quota = usage["quota_bytes"]
    out(f"tenant {usage['tenant'] or '(open API)'}: {usage['used_bytes']} bytes used of "
         + (f"{quota} ({100 * usage['used_bytes'] / quota:.1f}%)" if quota else "no quota"))
    for kind, n in usage["bytes"].items():
        out(f"  {kind:<15}{n:>16}")
    out("  " + ", ".join(f"{k} {v}" for k, v in usage["counts"].items()))
    if usage["retention_days"]:
        out(f"  finished jobs' artifacts are removed after {usage['retention_days']:g} days")



# ---- the command line ------------------------------------------------------------------------------

def _connection(parser: argparse.ArgumentParser, suppress: bool) -> None:
    default = (lambda value: argparse.SUPPRESS) if suppress else (lambda value: value)
    parser.add_argument("--url", default=default(None),
                        help="the service (default: $DTP_LAYOUT_URL, else http://127.0.0.1:8000)")
    parser.add_argument("--api-key", default=default(None),
                        help="API key, sent as X-API-Key (default: $DTP_LAYOUT_API_KEY; prefer the variable: "
                             "arguments show in the process list)")
    parser.add_argument("--http-timeout", type=float, default=default(30.0), metavar="S",
                        help="seconds to wait for each HTTP answer (default: 30)")


def _positive(kind: type) -> Any:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if value < 0:
            raise argparse.ArgumentTypeError(f"expected a value ≥ 0, got {text!r}")
        return value

    return parse


def _wait_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--timeout", type=_positive(float), metavar="S",
                   help="give up after S seconds (exit 3: the job is still queued or running)")
    p.add_argument("--interval", type=_positive(float), default=2.0, metavar="S", help="poll every S seconds (2)")


def register(sub: Any) -> None:
    client = sub.add_parser("client", help="talk to a layout service: submit, status, wait, cancel, list, download, "
                                           "scores, delete, upload, uploads, delete-upload, usage (for scripts and "
                                           "CI)",
                            description="A client of the layout service's /v1 API. Exit status: 0 done; 1 the job "
                                        "failed or was cancelled, a download's sha256 did not match, or the scores "
                                        "gate failed; 2 the service is unreachable or refused the request (bad key, "
                                        "unknown job, invalid spec); 3 the job has not finished (download or scores "
                                        "of a queued or running job, a wait whose --timeout ran out).")
    _connection(client, suppress=False)
    commands = client.add_subparsers(dest="client_command", required=True, metavar="COMMAND")
    common = argparse.ArgumentParser(add_help=False)
    _connection(common, suppress=True)

    p = commands.add_parser("submit", parents=[common], help="submit a job (prints its id)",
                            description="Submit a job from a JSON spec file (or - for stdin) and/or flags (flags "
                                        "override the file). Prints the job id; with --wait, follows the job: "
                                        "exit 0 when it succeeds, 1 when it fails or is cancelled, 3 when "
                                        "--timeout runs out first.")
    p.add_argument("spec", nargs="?", help="job spec JSON file, or - for stdin (the body of POST /v1/jobs)")
    add_spec_flags(p, "submit")  # one flag per field of the job spec (models/run/jobspec.py)
    p.add_argument("--wait", action="store_true", help="follow the job (exit status as `wait`)")
    _wait_args(p)
    p.add_argument("--json", action="store_true", help="print the job as JSON instead of its id")
    p.set_defaults(client_func=cmd_submit)

    p = commands.add_parser("status", parents=[common], help="a job's status, stage, progress and scores")
    p.add_argument("job")
    p.add_argument("--json", action="store_true")
    p.set_defaults(client_func=cmd_status)

    p = commands.add_parser("wait", parents=[common], help="follow a job until it finishes (0 succeeded, 1 "
                                                          "failed or cancelled, 3 --timeout ran out)")
    p.add_argument("job")
    _wait_args(p)
    p.add_argument("--json", action="store_true", help="print the final job as JSON")
    p.set_defaults(client_func=cmd_wait)

    p = commands.add_parser("cancel", parents=[common], help="cancel a queued or running job")
    p.add_argument("job")
    p.set_defaults(client_func=cmd_cancel)

    p = commands.add_parser("list", parents=[common], help="jobs, newest first")
    p.add_argument("--status", choices=STATUSES)
    p.add_argument("--model")
    p.add_argument("--devices", type=int)
    p.add_argument("--delta", type=int, help="short for --schedule dtp:δ")
    p.add_argument("--schedule", metavar="S", help=f"only jobs of this schedule ({ACCEPTED})")
    p.add_argument("--owner")
    p.add_argument("--limit", type=int, default=20, help="at most this many (default: 20)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(client_func=cmd_list)

    p = commands.add_parser("download", parents=[common], help="a job's artifacts, resumable, sha256-checked",
                            description="Downloads the job's artifacts (or those named: exact names, a directory "
                                        "such as shards or checkpoint, or a kind such as report) under --out, laid "
                                        "out as the worker wrote them (checkpoint/, shards/, …). An interrupted "
                                        "download leaves NAME.part files that the next run resumes with Range; "
                                        "files already complete are skipped; every sha256 is checked (exit 1 on a "
                                        "mismatch, the bad file deleted). Only a succeeded job has artifacts to "
                                        "download: exit 1 for a failed or cancelled job, 3 for a queued or running "
                                        "one, nothing written.")
    p.add_argument("job")
    p.add_argument("names", nargs="*", metavar="NAME")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--json", action="store_true", help="print what was downloaded as JSON")
    p.set_defaults(client_func=cmd_download)

    p = commands.add_parser("scores", parents=[common], help="the latest scores of a model; a CI gate with "
                                                            "--min-ratio / --min-gain",
                            description="Prints J per layout of the latest succeeded job matching the filters (or "
                                        "of --job ID). With --min-ratio R, exits 1 unless J(--layout) ≥ R × "
                                        "J(--reference); with --min-gain X, unless (J − E) / E ≥ X for the random "
                                        "expectation E = (2N−1)/L. --job of a failed or cancelled job exits 1, of a "
                                        "queued or running one 3.")
    p.add_argument("--model", help="the latest succeeded job of this model (with the filters below)")
    p.add_argument("--job", help="this job's scores instead (what a pipeline that just submitted it wants)")
    p.add_argument("--devices", "-L", type=int)
    p.add_argument("--delta", "-d", type=int, help="short for --schedule dtp:δ")
    p.add_argument("--schedule", metavar="S", help=f"the latest succeeded job of this schedule ({ACCEPTED})")
    p.add_argument("--score", choices=SCORES)
    p.add_argument("--revision")
    p.add_argument("--layout", default="optimised", help="the layout gated (default: optimised)")
    p.add_argument("--reference", default="contiguous", help="the layout --min-ratio compares with (contiguous)")
    threshold = p.add_mutually_exclusive_group()
    threshold.add_argument("--min-ratio", type=_positive(float), metavar="R")
    threshold.add_argument("--min-gain", type=float, metavar="X", help="e.g. 0.3: at least 30%% over random")
    p.add_argument("--json", action="store_true")
    p.set_defaults(client_func=cmd_scores)

    p = commands.add_parser("delete", parents=[common], help="remove a finished job's artifacts (the job stays, "
                                                            "expired)",
                            description="Removes a finished job's artifacts from the service's store; the job, its "
                                        "layouts and scores stay (marked expired; downloads then answer 410). A "
                                        "queued or running job is refused (exit 2: cancel it first).")
    p.add_argument("job")
    p.add_argument("--json", action="store_true", help="print the job as JSON")
    p.set_defaults(client_func=cmd_delete)

    p = commands.add_parser("upload", parents=[common], help="upload a model directory or data file (prints its id)",
                            description="Uploads a model directory (config.json, *.safetensors, tokenizer files), "
                                        "one .gguf, or data (.txt, .jsonl, .npy of token ids; a directory of .txt) to "
                                        "the service, part by part with a progress bar, every file's sha256 "
                                        "verified by the service. Run it again after an interruption: it resumes "
                                        "the open upload of the same files, sending only the parts the service "
                                        "lacks. Prints the id (a job names the upload as upload:ID). Exit 1 when "
                                        "the service received a file whose sha256 differs (it changed while sent); "
                                        "2 when the service refused it (pickles, unknown files, a config past the "
                                        "server's limits, the storage quota).")
    p.add_argument("path", help="a model directory, a .gguf file, or a data file or directory")
    p.add_argument("--name", help="a label (default: the file or directory name)")
    p.add_argument("--kind", choices=("model", "data"), help="default: model for a directory with config.json or "
                                                              "a .gguf, else data")
    p.add_argument("--json", action="store_true", help="print the upload as JSON")
    p.set_defaults(client_func=cmd_upload)

    p = commands.add_parser("uploads", parents=[common], help="the tenant's uploads, newest first")
    p.add_argument("--json", action="store_true")
    p.set_defaults(client_func=cmd_uploads)

    p = commands.add_parser("delete-upload", parents=[common], help="delete an upload (refused while a queued or "
                                                                   "running job names it)")
    p.add_argument("upload")
    p.set_defaults(client_func=cmd_delete_upload)

    p = commands.add_parser("usage", parents=[common], help="the tenant's storage: bytes by kind, quota, counts")
    p.add_argument("--json", action="store_true")
    p.set_defaults(client_func=cmd_usage)

    client.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Dispatch, turning the client's errors into one line on stderr: exit status 2, or for a job with no
    results 1 (it failed or was cancelled) or 3 (it has not finished)."""
    from app.client.http import ClientError, JobNotSucceeded

    try:
        return int(args.client_func(args))
    except JobNotSucceeded as exc:
        err(f"dtp-layout client {args.client_command}: {exc}")
        return EXIT_FAILED if exc.finished else EXIT_NOT_FINISHED
    except ClientError as exc:
        err(f"dtp-layout client {args.client_command}: error: {exc}")
        return EXIT_ERROR
    except argparse.ArgumentTypeError as exc:
        err(f"dtp-layout client {args.client_command}: error: {exc}")
        return EXIT_ERROR
    except KeyboardInterrupt:
        err(f"dtp-layout client {args.client_command}: interrupted")
        return 130
    except BrokenPipeError:  # `… | head`: the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141

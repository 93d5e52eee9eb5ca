"""What `dtp-layout client` prints: its exit statuses, the job's state in one line, its status block, and
the progress a `wait` shows on stderr (app/cli/client/commands.py, app/cli/client/scores.py). Nothing here imports
torch.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from app.core.safe_text import for_log

EXIT_FAILED = 1
EXIT_ERROR = 2
EXIT_NOT_FINISHED = 3
UNREACHABLE_NOTICE_S = 30.0  # while `wait` retries a service that does not answer, a line this often


def shown(text: str) -> str:
    """`text` for a terminal: the service's answers carry text from tenants' files (a job's error), and
    no control character in it may move the cursor, erase a line or set the clipboard (issue 41). Every
    non-printable character but the line breaks this client writes itself is shown as an escape."""
    return for_log(text, keep="\n")


def out(text: str = "") -> None:
    print(shown(text), flush=True)


def err(text: str) -> None:
    print(shown(text), file=sys.stderr, flush=True)


def client_for(args: argparse.Namespace) -> Any:
    from app.client.http import LayoutClient

    return LayoutClient(args.url, args.api_key, timeout=args.http_timeout)


def fmt_s(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    seconds = float(seconds)
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def job_state(job: dict[str, Any]) -> str:
    """`running affinity 42% ETA 12s`, `succeeded`, `failed in loading: …`."""
    status = job["status"]
    if status == "running":
        text = f"running {job.get('stage') or 'starting'} {100 * (job.get('progress') or 0):.0f}%"
        return text + (f" ETA {fmt_s(job['eta_s'])}" if job.get("eta_s") is not None else "")
    if status == "failed":
        first = (job.get("error") or "").strip().splitlines()[:1]
        return (f"failed in {job.get('error_stage') or job.get('stage') or '?'}: "
                f"{for_log(first[0]) if first else 'no message'}")
    if status == "cancelled":
        return "cancelled" + (f" in {job['stage']}" if job.get("stage") else "")
    return str(status)


def schedule_of(job: dict[str, Any]) -> str:
    """The schedule a job runs, as the service names it (`schedule`, canonical); a service from before it
    did is answered from the spec: its `schedule`, else dtp:δ of its `delta` (the spec's shorthand)."""
    from models.schedules.grammar import dtp_spec

    if isinstance(job.get("schedule"), str):
        return str(job["schedule"])
    spec = job.get("spec") or {}
    if isinstance(spec.get("schedule"), str):
        return str(spec["schedule"])
    try:
        return str(dtp_spec(int(spec.get("delta", 1))))
    except (TypeError, ValueError):  # ScheduleError is a ValueError
        return "?"


def print_json(doc: Any) -> None:
    out(json.dumps(doc, indent=1, sort_keys=False))


def status_text(job: dict[str, Any]) -> str:
    from app.client.http import removed_text
    from models.serving.commands import serve_lines

    spec = job.get("spec") or {}
    model = spec.get("model") or {}
    lines = [f"job {job['id']}  {job_state(job)}",
             f"model {model.get('id')}" + (f" ({model['gguf_file']})" if model.get("gguf_file") else "")
             + f"  L={spec.get('devices')} schedule {schedule_of(job)} score {spec.get('score', 'fo')}"
             + (f"  owner {job['owner']}" if job.get("owner") else ""),
             f"submitted {job.get('created_at')}"
             + (f"  finished {job['finished_at']}" if job.get("finished_at") else "")]
    timings = job.get("timings") or {}
    if timings:
        lines.append("stages " + ", ".join(f"{k} {fmt_s(v)}" for k, v in timings.items()))
    if job.get("status") == "failed" and job.get("error"):
        lines.append(f"error: {for_log(job['error'])}")  # one line: its line breaks shown as \n
    if removed := removed_text(job):
        lines.append(f"artifacts {removed} (the job, its layouts and scores stay)")
    layouts = (job.get("summary") or {}).get("layouts") or {}
    if layouts:
        summary = job["summary"]
        lines.append(f"{'layout':<16}{'J':>9}")
        lines += [f"{name:<16}{value:>9.3f}" for name, value in sorted(layouts.items(), key=lambda kv: -kv[1])]
        lines.append(f"random expectation {summary.get('random_expectation', 0):.3f}; "
                     f"upper bound {summary.get('upper_bound', 0):.3f}")
    if not job.get("expired_at"):  # the shards are still there to download
        lines += serve_lines((job.get("summary") or {}).get("serve"))
    return "\n".join(lines)


def distill_lines(metrics_summary: dict[str, Any] | None) -> list[str]:
    """The distillation's headline (GET /v1/jobs/{id}/metrics `summary`): each layout's final KL and when
    the candidate reaches the reference's final KL; nothing before the distilling stage published it."""
    head = (metrics_summary or {}).get("headline")
    if not isinstance(head, dict):
        return []

    def kl(value: Any) -> str:
        return f"{value:.3f}" if isinstance(value, int | float) else "n/a"

    lines = [f"distillation: final KL {head.get('candidate')} {kl(head.get('candidate_final_kl'))} vs "
             f"{head.get('reference')} {kl(head.get('reference_final_kl'))} (nats/token, step "
             f"{head.get('reference_final_step')})"]
    if head.get("said"):
        lines.append(f"  {head['said']}")
    if isinstance(ppl := (metrics_summary or {}).get("dense_ppl"), int | float):
        lines.append(f"  dense perplexity {ppl:.3f}")
    return lines


class Follower:
    """Shows a job's progress on stderr: a bar per stage on a terminal, a line per change in a log."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.tty = sys.stderr.isatty()
        self.bar: Any = None
        self.stage: str | None = None
        self.last_line = ""
        self.last_time = 0.0
        self.t0 = time.monotonic()
        self.down_since: float | None = None  # the service has not answered since then
        self.down_noticed = 0.0

    def __call__(self, job: dict[str, Any]) -> None:
        self.answered()
        if self.tty and job["status"] == "running":
            from tqdm import tqdm

            stage = job.get("stage") or "starting"
            if stage != self.stage:
                if self.bar is not None:
                    self.bar.close()
                self.bar = tqdm(total=100, desc=stage, file=sys.stderr, leave=False, unit="%",
                                bar_format="{desc:<12} {bar} {n:.0f}% {postfix}")
                self.stage = stage
            self.bar.n = round(100 * (job.get("progress") or 0), 1)
            self.bar.set_postfix_str(f"ETA {fmt_s(job['eta_s'])}" if job.get("eta_s") is not None else "")
            return
        line = job_state(job)
        now = time.monotonic()
        changed = line.split(" ")[:2] != self.last_line.split(" ")[:2]
        if changed or now - self.last_time >= 30:
            err(f"[{fmt_s(now - self.t0):>7}] {line}")
            self.last_line, self.last_time = line, now

    def unreachable(self, error: Exception, down_s: float, retry_s: float, now: float | None = None) -> None:
        """A try that did not reach the service: a line at the first, then every UNREACHABLE_NOTICE_S."""
        now = time.monotonic() if now is None else now
        if self.down_since is not None and now - self.down_noticed < UNREACHABLE_NOTICE_S:
            return
        self.close()
        reason = str(error).removeprefix(f"cannot reach the service at {self.url}: ")
        first = self.down_since is None
        self.down_since = self.down_since if not first else now - down_s
        self.down_noticed = now
        err(f"[{fmt_s(now - self.t0):>7}] service at {self.url} unreachable ({reason}); "
             + (f"retrying for up to {retry_s:.0f} s" if first else
                f"still retrying ({down_s:.0f} s so far, up to {retry_s:.0f} s more)"))

    def answered(self) -> None:
        if self.down_since is not None:
            err(f"[{fmt_s(time.monotonic() - self.t0):>7}] service at {self.url} answers again "
                 f"(after {time.monotonic() - self.down_since:.0f} s)")
            self.down_since = None

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


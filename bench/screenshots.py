"""Screenshots of the dashboard for docs/dashboard.md, from a running service.

    .venv/bin/dtp-layout serve --port 8777 &        # then run the jobs of docs/dashboard.md
    .venv/bin/python bench/screenshots.py --url http://127.0.0.1:8777 --job JOB --out docs/screenshots
    .venv/bin/python bench/screenshots.py --url … --job RUNNING_JOB --live   # job-live.png, mid-distillation

Takes, at 1280×800: the jobs list, the submit form, the job (whole page), the scores page of the
job's model; at 390×844 (a phone): the jobs list and the job's per-layer plot. Drives Debian's
Chromium through Playwright (tests/browser_kit.py).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.client.http import LayoutClient
from tests.browser_kit import browser_context, unavailable

WIDE = {"width": 1280, "height": 800}
NARROW = {"width": 390, "height": 844}


def _open(context, url: str, key: str | None):
    page = context.new_page()
    if key:  # the key the dashboard would ask for, put where it keeps it (never in a URL)
        page.add_init_script(f"sessionStorage.setItem('dtp-layout-api-key', {key!r})")
    page.on("pageerror", lambda exc: print(f"page error: {exc}", file=sys.stderr))
    return page


def _settle(page, selector: str) -> None:
    page.wait_for_selector(selector, state="attached", timeout=60_000)
    page.wait_for_timeout(600)  # let the charts finish sizing to their boxes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--api-key", default=os.environ.get("DTP_LAYOUT_API_KEY"))
    ap.add_argument("--job", required=True, help="the job shown (ideally one with distillation)")
    ap.add_argument("--model", help="the scores page's model (default: the job's)")
    ap.add_argument("--live", action="store_true", help="only job-live.png: the job while it runs")
    ap.add_argument("--out", type=Path, default=Path("docs/screenshots"))
    args = ap.parse_args()
    reason = unavailable()
    if reason:
        print(reason, file=sys.stderr)
        return 2
    from playwright.sync_api import sync_playwright

    args.out.mkdir(parents=True, exist_ok=True)
    base = args.url.rstrip("/")
    with sync_playwright() as p:
        with browser_context(p, **WIDE) as context:
            page = _open(context, base, args.api_key)
            page.goto(f"{base}/ui/jobs/{args.job}")
            if args.live:
                _settle(page, "#live-progress")
                _settle(page, "figure[data-chart=distill-kl] path.series-line")
                page.screenshot(path=args.out / "job-live.png", full_page=True)
                print(args.out / "job-live.png")
                return 0
            _settle(page, "#artifacts-table")
            _settle(page, "figure[data-chart=fractions-up] path.series-line")
            page.screenshot(path=args.out / "job.png", full_page=True)
            model = args.model or LayoutClient(base, args.api_key).job(args.job)["spec"]["model"]["id"]
            page.goto(f"{base}/ui/")
            _settle(page, "#jobs-table tbody tr[data-job]")
            page.screenshot(path=args.out / "jobs.png")
            page.goto(f"{base}/ui/submit")
            _settle(page, "#submit-form #submit-job:enabled")  # the server's defaults are in
            page.check("#f-distill")
            page.wait_for_timeout(300)
            page.screenshot(path=args.out / "submit.png", full_page=True)
            page.goto(f"{base}/ui/scores?model={model}")
            _settle(page, "section[data-group] figure circle.point")
            page.screenshot(path=args.out / "scores.png", full_page=True)
        with browser_context(p, **NARROW) as context:
            page = _open(context, base, args.api_key)
            page.goto(f"{base}/ui/")
            _settle(page, "#jobs-table tbody tr[data-job]")
            page.screenshot(path=args.out / "jobs-narrow.png")
            page.goto(f"{base}/ui/jobs/{args.job}")
            _settle(page, "figure[data-chart=fractions-up] path.series-line")
            page.evaluate("document.getElementById('fractions').scrollIntoView()")
            page.wait_for_timeout(300)
            page.screenshot(path=args.out / "job-narrow.png")
    for name in ("job.png", "jobs.png", "submit.png", "scores.png", "jobs-narrow.png", "job-narrow.png"):
        print(args.out / name)
    return 0


if __name__ == "__main__":
    sys.exit(main())

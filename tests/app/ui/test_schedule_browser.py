"""The dashboard shows each job's schedule (issue 43): the jobs list has a schedule column and filter, the
job page names it, and the scores page keeps a dtp:1 job and a pt:2 job of one model apart, each with
the gate command for its own schedule (it grouped them by δ: one chart, one `--delta 1` gate). Real
headless Chromium against a real `dtp-layout serve` (API keys on)."""

from __future__ import annotations

import time

import pytest

from tests import browser_kit
from tests.app.conftest import API_KEYS
from tests.app.ui.test_ui_browser import Watch, enter_key
from tests.service_kit import delete_jobs, make_settings, seed_finished_job

pytestmark = [pytest.mark.worker, pytest.mark.browser]

MODEL = "ui-schedules-model"


@pytest.fixture
def two_schedules(keyed_service):
    """A dtp:1 job and a pt:2 job of MODEL, both alice's."""
    settings = make_settings(keyed_service.var)
    jobs = {s: seed_finished_job(settings, model_id=MODEL, owner="alice", schedule=s)[0] for s in ("dtp:1", "pt:2")}
    yield jobs
    delete_jobs(settings, list(jobs.values()))


def test_the_list_job_page_and_scores_show_the_schedule(keyed_service, playwright, two_schedules):
    url, jobs = keyed_service.url, two_schedules
    with browser_kit.browser_context(playwright, width=1280, height=800) as context:
        page = context.new_page()
        watch = Watch(page)
        page.goto(f"{url}/ui/?model={MODEL}")
        enter_key(page, API_KEYS["alice"])
        for schedule, job_id in jobs.items():
            cell = page.wait_for_selector(f"tr[data-job='{job_id}'] [data-col=schedule]")
            assert cell.text_content() == schedule
        page.fill("#filter-schedule", "pt:02")  # any form of the grammar: the server compares it canonical
        page.press("#filter-schedule", "Enter")
        # the filtered list, not the emptied table between the two (the dtp:1 row is gone from both); polled from
        # here: the page's CSP refuses wait_for_function's string evaluation
        page.wait_for_selector(f"tr[data-job='{jobs['pt:2']}']")
        deadline = time.monotonic() + 30
        while page.query_selector(f"tr[data-job='{jobs['dtp:1']}']") is not None and time.monotonic() < deadline:
            page.wait_for_timeout(100)
        page.wait_for_selector(f"tr[data-job='{jobs['pt:2']}']")
        assert page.query_selector(f"tr[data-job='{jobs['dtp:1']}']") is None
        assert "schedule=pt%3A02" in page.url
        assert page.query_selector(f"tr[data-job='{jobs['pt:2']}']") is not None

        page.goto(f"{url}/ui/jobs/{jobs['pt:2']}")
        page.wait_for_selector("text=Devices L · schedule")
        assert "2 · pt:2" in page.text_content("main")

        page.goto(f"{url}/ui/scores?model={MODEL}")
        for schedule in jobs:
            group = page.wait_for_selector(f"section[data-group='2|{schedule}|fo']")
            assert f"schedule {schedule}" in group.query_selector("h2").text_content()
            assert f"--schedule {schedule} " in group.query_selector("code").text_content()
        assert watch.api_errors() == []

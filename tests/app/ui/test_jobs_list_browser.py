"""The jobs list and the job page tell a finished job's time the same way (issue 30, item 12: the list
showed the stages' sum, "5 stages · 3m 54s", the job page "submitted to finished: 3m 59s"), and the
jobs list at phone width (390 px) has the owner filter. Real headless Chromium against a real
`dtp-layout serve` (API keys on)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import update

from app.core.db import Job, database
from tests import browser_kit
from tests.app.conftest import API_KEYS
from tests.app.ui.test_ui_browser import Watch, enter_key, no_horizontal_overflow, shot
from tests.service_kit import delete_jobs, make_settings, seed_finished_job

pytestmark = [pytest.mark.worker, pytest.mark.browser]


def test_list_and_job_page_agree_on_the_time_and_the_narrow_list_filters_by_owner(keyed_service, playwright,
                                                                                   tmp_path):
    url = keyed_service.url
    settings = make_settings(keyed_service.var)
    job_id, _ = seed_finished_job(settings, model_id="wall-time-model", owner="alice")
    # submitted 3m 59s before it finished; its 5 stages ran 3m 54s (the rest: queued, between stages)
    timings = {"loading": 10.0, "calibration": 4.0, "affinity": 200.0, "optimising": 16.0, "exporting": 4.0}
    db = database(settings.database_url)
    with db.transaction() as session:
        job = session.get(Job, job_id)
        session.execute(update(Job).where(Job.id == job_id).values(
            created_at=job.finished_at - timedelta(seconds=239), started_at=job.finished_at - timedelta(seconds=236),
            timings=timings, stages_done=list(timings)))
    try:
        with browser_kit.browser_context(playwright, width=1280, height=800) as context:
            page = context.new_page()
            watch = Watch(page)
            page.goto(f"{url}/ui/?model=wall-time-model")
            enter_key(page, API_KEYS["alice"])
            cell = page.wait_for_selector(f"tr[data-job='{job_id}'] [data-col=stage] span")
            listed = cell.text_content()
            assert listed == "5 stages · 3m 59s", listed  # before: the stages' sum, 3m 54s
            assert "submitted to finished" in cell.get_attribute("title")
            listed_wall = cell.get_attribute("data-wall")
            page.goto(f"{url}/ui/jobs/{job_id}")
            wall = page.wait_for_selector("#wall-time")
            assert wall.get_attribute("data-wall") == "3m 59s" == listed_wall
            assert "Submitted to finished: 3m 59s" in wall.text_content()
            assert "the stages themselves ran 3m 54s" in wall.text_content()
            assert watch.api_errors() == []

        with browser_kit.browser_context(playwright, width=390, height=844) as context:
            page = context.new_page()
            watch = Watch(page)
            page.goto(f"{url}/ui/")
            enter_key(page, API_KEYS["alice"])
            page.wait_for_selector(f"tr[data-job='{job_id}']")
            owner = page.wait_for_selector("#filter-owner")
            assert owner.is_visible()  # before: hidden at phone width
            owner.fill("someone-else")
            page.press("#filter-owner", "Enter")
            page.wait_for_selector("td.empty-row")
            assert "owner=someone-else" in page.url
            assert page.query_selector(f"tr[data-job='{job_id}']") is None
            page.fill("#filter-owner", "alice")
            page.press("#filter-owner", "Enter")
            row = page.wait_for_selector(f"tr[data-job='{job_id}']")
            assert "owner=alice" in page.url
            assert "alice" in row.text_content()  # the owner shows on the narrow card too
            assert no_horizontal_overflow(page)
            shot(page, tmp_path, "jobs-narrow-owner")
            assert watch.api_errors() == []
    finally:
        delete_jobs(settings, [job_id])

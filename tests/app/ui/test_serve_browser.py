"""The job page's *Serve with vLLM* block (issue 28) in a real headless Chromium against a real `dtp-layout
serve` (API keys on): a succeeded job whose summary carries `serve` shows the client's download of its shards
and `dtp-layout vllm-serve` at TP = L, as the summary words them, and where to read more; a succeeded job
without shards, a failed job, and a job whose artifacts were deleted show no block. What the summary holds
is text: markup in it is shown, never parsed."""

from __future__ import annotations

import pytest
from sqlalchemy import update

from app.core.db import Job, database
from models.serving.commands import SERVING_DOC, serve_commands
from tests import browser_kit
from tests.app.conftest import API_KEYS
from tests.app.ui.test_ui_browser import Watch, enter_key, shot
from tests.service_kit import delete_jobs, make_settings, seed_finished_job, seed_job

pytestmark = [pytest.mark.worker, pytest.mark.browser]

BASE_SUMMARY = {"tokens": 256, "random_expectation": 2.5, "upper_bound": 4.0,
                "layouts": {"optimised": 3.5, "contiguous": 2.4}}


@pytest.fixture(scope="module")
def playwright():
    with browser_kit.playwright_or_skip() as p:
        yield p


def _set(settings, job_id: str, **values) -> None:
    with database(settings.database_url).transaction() as session:
        session.execute(update(Job).where(Job.id == job_id).values(**values))


def _serve(job_id: str, devices: int = 2) -> dict:
    return {"available": True, "devices": devices, "schedule": "dtp:1", "architecture": "DtpLlamaForCausalLM",
            "commands": serve_commands(job_id, devices), "docs": SERVING_DOC}


def test_the_job_page_shows_how_to_serve_a_job_with_shards_and_nothing_for_one_without(keyed_service, playwright,
                                                                                      tmp_path):
    url = keyed_service.url
    settings = make_settings(keyed_service.var)
    with_shards, _ = seed_finished_job(settings, model_id="serve-model", owner="alice")
    _set(settings, with_shards, summary={**BASE_SUMMARY, "serve": _serve(with_shards)})
    no_shards, _ = seed_finished_job(settings, model_id="serve-model", owner="alice")
    _set(settings, no_shards, summary={**BASE_SUMMARY, "serve": {"available": False, "why": "no shards"}})
    failed = seed_job(settings, status="failed", model_id="serve-model", owner="alice")
    hostile, _ = seed_finished_job(settings, model_id="serve-model", owner="alice")
    markup = '<img id="injected" src="x"> <b>bold</b>'
    _set(settings, hostile, summary={**BASE_SUMMARY, "serve": {**_serve(hostile, 3), "schedule": markup,
                                                               "commands": [f"dtp-layout vllm-serve '{markup}'"]}})
    try:
        with browser_kit.browser_context(playwright, width=1280, height=800) as context:
            page = context.new_page()
            watch = Watch(page)
            page.goto(f"{url}/ui/jobs/{with_shards}")
            enter_key(page, API_KEYS["alice"])
            card = page.wait_for_selector("#serve:not([hidden])")
            assert card.query_selector("h2").text_content() == "Serve with vLLM"
            commands = [el.text_content() for el in card.query_selector_all("pre.serve-command")]
            assert commands == [
                f"dtp-layout client download {with_shards} shards --out ./{with_shards[:8]}",
                f"dtp-layout vllm-serve ./{with_shards[:8]}/shards  # vLLM at --tensor-parallel-size 2, the shards' L",
            ]
            assert page.text_content("#serve-tp") == "tensor-parallel size 2"
            assert page.text_content("#serve-docs") == "docs/serving.md"
            assert len(card.query_selector_all("button")) == 2  # a copy button per command
            page.wait_for_selector("#artifacts-table")  # the rest of the page is there too
            shot(page, tmp_path, "job-serve")

            for job_id in (no_shards, failed):
                page.goto(f"{url}/ui/jobs/{job_id}")
                page.wait_for_selector("#job-header h1")
                page.wait_for_selector("#artifacts .muted, #artifacts-table")  # the page has loaded its parts
                assert page.is_hidden("#serve"), job_id
                assert page.query_selector("pre.serve-command") is None

            page.goto(f"{url}/ui/jobs/{hostile}")
            card = page.wait_for_selector("#serve:not([hidden])")
            assert page.query_selector("#injected") is None and card.query_selector("b") is None
            assert card.query_selector("pre.serve-command").text_content() == f"dtp-layout vllm-serve '{markup}'"
            assert markup in card.text_content()

            # Once the artifacts are deleted there is nothing to download: the block goes.
            page.on("dialog", lambda dialog: dialog.accept())
            page.goto(f"{url}/ui/jobs/{with_shards}")
            page.wait_for_selector("#serve:not([hidden])")
            page.click("#delete-job")
            page.wait_for_selector("#artifacts-expired")
            assert page.is_hidden("#serve")
            assert watch.api_errors() == [], watch.errors
    finally:
        delete_jobs(settings, [with_shards, no_shards, failed, hostile])

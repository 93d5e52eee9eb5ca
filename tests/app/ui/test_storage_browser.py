"""The dashboard's Storage page and the job page's Delete button in a real headless Chromium against a
real `dtp-layout serve` (API keys on): the usage against the quota, a data file uploaded through the
form (sha256 computed in the browser, sent as parts, verified by the service), the upload deleted from
the table; a finished job's artifacts deleted from its page (downloads then 410). Screenshots go to the
test's tmp dir (and to $DTP_LAYOUT_SCREENSHOT_DIR when set)."""

from __future__ import annotations

import httpx
import pytest

from tests import browser_kit
from tests.app.conftest import API_KEYS
from tests.app.ui.test_ui_browser import Watch, enter_key, shot
from tests.service_kit import make_settings, seed_finished_job

pytestmark = [pytest.mark.worker, pytest.mark.browser]


def test_storage_page_uploads_and_deletes_and_the_job_page_deletes_artifacts(keyed_service, playwright, tmp_path):
    url = keyed_service.url
    headers = {"X-API-Key": API_KEYS["alice"]}
    job_id, _ = seed_finished_job(make_settings(keyed_service.var), model_id="browser-model", owner="alice")
    text = tmp_path / "notes.txt"
    text.write_text("the calibration text of this tenant\n" * 2000)
    with browser_kit.browser_context(playwright, width=1280, height=800) as context:
        page = context.new_page()
        watch = Watch(page)
        page.on("dialog", lambda dialog: dialog.accept())  # the confirm() of each Delete
        page.goto(f"{url}/ui/storage")
        enter_key(page, API_KEYS["alice"])
        page.wait_for_selector("#usage-total")
        page.set_input_files("#upload-files", str(text))
        page.fill("#upload-name", "notes")
        page.click("#upload-send")
        page.wait_for_selector("#upload-status:has-text('Complete')", timeout=30_000)  # the CSP forbids eval
        status = page.text_content("#upload-status")
        upload_id = status.rsplit("upload:", 1)[1].strip()
        row = page.wait_for_selector(f"tr[data-upload='{upload_id}']")
        assert "complete" in row.text_content()
        listed = httpx.get(f"{url}/v1/uploads/{upload_id}", headers=headers).json()
        assert listed["status"] == "complete" and listed["size"] == text.stat().st_size
        assert listed["name"] == "notes" and listed["files"][0]["path"] == "notes.txt"
        assert "data uploads" in page.text_content("#usage-bytes")
        shot(page, tmp_path, "storage")
        page.click(f"button[data-delete-upload='{upload_id}']")
        page.wait_for_selector(f"tr[data-upload='{upload_id}']", state="detached")
        assert httpx.get(f"{url}/v1/uploads/{upload_id}", headers=headers).status_code == 404

        page.goto(f"{url}/ui/jobs/{job_id}")
        page.click("#delete-job")
        page.wait_for_selector("#artifacts-expired")
        assert "deleted" in page.text_content("#artifacts-expired")
        assert page.query_selector("#delete-job") is None
        shot(page, tmp_path, "job-deleted")
        r = httpx.get(f"{url}/v1/jobs/{job_id}/artifacts/report.json", headers=headers)
        assert r.status_code == 410
        assert watch.api_errors() == [], watch.errors

"""`dtp-layout client` on a job whose artifacts were deleted (issue 30, item 8), against a real
`dtp-layout serve` (embedded default, API keys on): the job read, the artifacts list, `status` and
`download` all say the artifacts are gone, and `download` makes nothing."""

from __future__ import annotations

import pytest

from app.client.http import LayoutClient
from tests.app.client.test_client import run
from tests.service_kit import delete_jobs, make_settings, seed_finished_job

pytestmark = [pytest.mark.worker]


def test_after_delete_the_job_its_artifacts_status_and_download_say_they_are_gone(env, tmp_path):
    """Issue 30 item 8: after `client delete`, the artifacts list still named every file (each link 410),
    `client status` said nothing and `client download` left an empty shards/ folder."""
    settings = make_settings(env.var)
    job_id, _ = seed_finished_job(settings, model_id="deleted-artifacts", owner="ci")  # report.json, shards/blob.bin
    try:
        with LayoutClient() as client:
            assert len(client.artifacts(job_id)) == 2
            code, _, err = run("delete", job_id)
            assert code == 0, err
            job = client.job(job_id)
            listing = client.request("GET", f"/v1/jobs/{job_id}/artifacts").json()
        # the job read: deleted, and when
        assert job["expired_reason"] == "deleted" and job["expired_at"], job
        # the artifacts list: nothing to download, and why (200: the job is there, its files are not)
        assert listing == {"items": [], "expired_at": job["expired_at"], "expired_reason": "deleted", "removed": 2}
        # `client status` says so
        code, out, _ = run("status", job_id)
        assert code == 0 and f"artifacts deleted on {job['expired_at']}" in out, out
        # `client download` refuses in one line, without making a folder
        out_dir = tmp_path / "download"
        code, out, err = run("download", job_id, "--out", str(out_dir))
        assert code == 2 and len(err.strip().splitlines()) == 1, (out, err)
        assert f"job {job_id}: its artifacts were deleted on {job['expired_at']}" in err, err
        assert not out_dir.exists()
    finally:
        delete_jobs(settings, [job_id])

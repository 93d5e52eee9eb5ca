"""How to serve a job's shards (issue 28), as `dtp-layout client status` prints it for a real job run by a
real `dtp-layout serve` (embedded default, API keys on): the summary's lines with L from the exported
manifest, and those commands run as printed: the download fetches the shards alone, and `vllm-serve`
(a dry run: no vLLM here) serves them at tensor-parallel size 2."""

from __future__ import annotations

import contextlib
import io
import shlex
import sys

import pytest

from app.cli.main import main
from tests.app.client.test_client import run, submitted  # noqa: F401  (a fixture; `env` is in conftest.py)

pytestmark = [pytest.mark.worker]


def test_status_prints_how_to_serve_and_the_commands_run_as_printed(env, submitted, tmp_path, monkeypatch):  # noqa: F811
    job_id, _ = submitted
    monkeypatch.chdir(tmp_path)
    code, out, _ = run("status", job_id)
    assert code == 0
    assert out.splitlines()[-3:] == [
        "serve with vLLM (TP = L = 2, schedule dtp:1; docs/serving.md):",
        f"  dtp-layout client download {job_id} shards --out ./{job_id[:8]}",
        f"  dtp-layout vllm-serve ./{job_id[:8]}/shards  # vLLM at --tensor-parallel-size 2, the shards' L"]
    download, serve = (shlex.split(line, comments=True) for line in out.splitlines()[-2:])
    code, _, err = run(*download[2:])  # after `dtp-layout client`
    assert code == 0, err
    assert (tmp_path / job_id[:8] / "shards" / "manifest.json").is_file()
    assert not (tmp_path / job_id[:8] / "checkpoint").exists()  # the shards only
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main([*serve[1:], "--dry-run", "--python", sys.executable]) == 0
    assert "on TP=2" in printed.getvalue() and "--tensor-parallel-size 2" in printed.getvalue()

"""How to serve a job's shards, as its summary carries it (issue 28): the client's download of `shards/` and
`dtp-layout vllm-serve` at TP = the manifest's L, or why there is nothing to serve; and the lines
`dtp-layout client status` prints from it. Without vLLM, torch only for the export."""

from __future__ import annotations

import json
from pathlib import Path

from app.cli.client.output import status_text
from models.export.resident import export_rank_shards, permuted_copy
from models.families import model_shape
from models.layouts import layout as lay
from models.serving.commands import SERVING_DOC, serve_commands, serve_lines, serve_summary
from tests.tiny import fresh

JOB = "0123456789abcdef0123456789abcdef"


def _shards(tmp_path: Path) -> Path:
    model = fresh("llama")
    layout = lay.random(model_shape(model.config), 2, 1, seed=3)
    return export_rank_shards(permuted_copy(model, layout), layout, tmp_path / "shards", schedule="dtp:1")


def test_the_commands_are_the_clients_download_then_vllm_serve():
    assert serve_commands(JOB, 4) == [
        "dtp-layout client download 0123456789abcdef0123456789abcdef shards --out ./01234567",
        "dtp-layout vllm-serve ./01234567/shards  # vLLM at --tensor-parallel-size 4, the shards' L",
    ]
    # an id that is not plain hex is quoted for the shell, never spliced in
    assert serve_commands("a b;rm", 2)[0] == "dtp-layout client download 'a b;rm' shards --out './a b;rm'"


def test_the_summary_of_a_job_with_shards_reads_l_from_their_manifest(tmp_path):
    shards = _shards(tmp_path)
    serve = serve_summary(JOB, exported_shards=True, shards_dir=shards)
    assert serve == {"available": True, "devices": 2, "schedule": "dtp:1", "architecture": "DtpLlamaForCausalLM",
                     "commands": serve_commands(JOB, 2), "docs": SERVING_DOC}
    assert json.loads(json.dumps(serve)) == serve  # stored as JSON in the job row
    assert serve_lines(serve) == [
        "serve with vLLM (TP = L = 2, schedule dtp:1; docs/serving.md):",
        "  dtp-layout client download 0123456789abcdef0123456789abcdef shards --out ./01234567",
        "  dtp-layout vllm-serve ./01234567/shards  # vLLM at --tensor-parallel-size 2, the shards' L",
    ]


def test_a_job_without_shards_says_why(tmp_path):
    off = serve_summary(JOB, exported_shards=False, shards_dir=None)
    assert off["available"] is False and "export.shards false" in off["why"]
    assert serve_lines(off) == [f"serve with vLLM: not available: {off['why']}"]
    missing = serve_summary(JOB, exported_shards=True, shards_dir=tmp_path / "nothing")
    assert missing == {"available": False, "why": "no shards/manifest.json was exported"}
    old = tmp_path / "old"
    old.mkdir()
    (old / "manifest.json").write_text(json.dumps({"format": "dtp-layout-shards/1", "devices": 2}))
    assert "no 'serving' record" in serve_summary(JOB, exported_shards=True, shards_dir=old)["why"]
    assert serve_lines(None) == []  # jobs that succeeded before `serve` was written show nothing


def test_client_status_prints_the_summarys_lines_unless_the_artifacts_are_gone(tmp_path):
    serve = serve_summary(JOB, exported_shards=True, shards_dir=_shards(tmp_path))
    job = {"id": JOB, "status": "succeeded", "spec": {"model": {"id": "m"}, "devices": 2}, "created_at": "t",
           "summary": {"layouts": {"optimised": 3.5}, "random_expectation": 2.5, "upper_bound": 4.0, "serve": serve}}
    text = status_text(job)
    assert text.endswith("\n".join(serve_lines(serve)))
    assert "vllm-serve" not in status_text({**job, "expired_at": "2026-01-01T00:00:00Z", "expired_reason": "deleted"})
    failed = {**job, "status": "failed", "error": "boom", "summary": None}
    assert "vllm-serve" not in status_text(failed) and "serve with vLLM" not in status_text(failed)

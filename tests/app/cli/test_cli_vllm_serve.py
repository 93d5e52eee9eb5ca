"""`dtp-layout vllm-serve` (issue 28) without starting vLLM: the command it would run (--dry-run), TP from
the manifest, the checkpoint path's --hf-overrides, and its refusals (exit 2, one line)."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pytest

from app.cli.commands.vllm_serve import cpu_binding
from app.cli.main import main


def _shards(tmp_path: Path, devices: int = 2, tokenizer: bool = True) -> Path:
    shards = tmp_path / "shards"
    shards.mkdir()
    serving = {"format": "dtp-layout-serving/1", "family": "llama", "model_type": "llama",
               "architecture": "DtpLlamaForCausalLM", "num_layers": 2, "devices": devices, "last_scale": "sqrt",
               "table": {"schedule": "dtp:1", "own_arrival": [1, 2, 3, 4], "own_scale": [1.5, 1, 1, 1.5],
                         "other_arrival": [2, 3, 4, None]},
               "provenance": {"layout": "random-1"}}
    (shards / "manifest.json").write_text(json.dumps({"format": "dtp-layout-shards/1", "serving": serving}))
    if tokenizer:
        (shards / "tokenizer.json").write_text("{}")
    return shards


def _command(capsys: pytest.CaptureFixture[str]) -> list[str]:
    out = capsys.readouterr().out
    return shlex.split(next(line for line in out.splitlines() if line.startswith("command: "))[9:])


def test_dry_run_serves_the_shards_at_tp_l(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shards = _shards(tmp_path)
    code = main(["vllm-serve", str(shards), "--port", "8123", "--python", sys.executable, "--dry-run", "--",
                 "--max-model-len", "256"])
    assert code == 0
    cmd = _command(capsys)
    assert cmd[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    joined = " ".join(cmd)
    assert f"--model {shards}" in joined and "--tensor-parallel-size 2" in joined and "--port 8123" in joined
    assert "--enforce-eager" in cmd and cmd[-2:] == ["--max-model-len", "256"] and "--hf-overrides" not in cmd


def test_the_checkpoint_path_takes_the_table_through_hf_overrides(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    shards = _shards(tmp_path)
    assert main(["vllm-serve", str(shards), "--checkpoint", str(tmp_path / "checkpoint"), "--python",
                 sys.executable, "--dry-run"]) == 0
    cmd = _command(capsys)
    overrides = json.loads(cmd[cmd.index("--hf-overrides") + 1])
    assert overrides["architectures"] == ["DtpLlamaForCausalLM"] and overrides["dtp"]["schedule"] == "dtp:1"
    assert cmd[cmd.index("--model") + 1] == str(tmp_path / "checkpoint")
    assert cmd[cmd.index("--tokenizer") + 1] == str(shards)


def test_no_tokenizer_skips_its_init_and_the_curl_sends_ids(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["vllm-serve", str(_shards(tmp_path, tokenizer=False)), "--python", sys.executable,
                 "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "--skip-tokenizer-init" in out and '"prompt": [1, 2, 3]' in out and "http://127.0.0.1:8100/v1" in out


@pytest.mark.parametrize("extra", [["--", "--tensor-parallel-size", "4"], ["--", "-tp=1"], ["--bogus"]])
def test_refusals_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str]) -> None:
    assert main(["vllm-serve", str(_shards(tmp_path)), "--python", sys.executable, "--dry-run", *extra]) == 2
    assert "dtp-layout vllm-serve: error:" in capsys.readouterr().err


def test_shards_without_a_serving_record_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shards = tmp_path / "old"
    shards.mkdir()
    (shards / "manifest.json").write_text(json.dumps({"format": "dtp-layout-shards/1"}))
    assert main(["vllm-serve", str(shards), "--python", sys.executable, "--dry-run"]) == 2
    assert "export them again" in capsys.readouterr().err


def test_cpu_binding_splits_the_cpus_per_rank() -> None:
    assert cpu_binding(2, [0, 1]) == "0|1"
    assert cpu_binding(2, list(range(16))) == "0-7|8-15"
    assert cpu_binding(4, [0, 1]) == "0|1|0|1"

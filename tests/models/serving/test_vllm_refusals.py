"""vLLM refuses shards it cannot run as exported, at load, with a message naming the fix (issue 28)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.models.serving.vllm_kit import EngineError, EngineHost, export_tiny, vllm_missing

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(vllm_missing() is not None, reason=vllm_missing() or "")]


def test_a_tensor_parallel_size_other_than_l_is_an_error_at_load(tmp_path: Path) -> None:
    """On an engine host of its own (a failed load may leave a one-rank process group behind in the host);
    `vllm serve` exits on the same error (docs/serving.md), which is vLLM's doing, not the plugin's."""
    shards = export_tiny(tmp_path / "e", case="llama", schedule="dtp:1") / "shards"
    host = EngineHost(tmp_path / "tp1.log")
    try:
        with pytest.raises(EngineError) as refused:
            host.load(shards, tp=1)
    finally:
        host.stop()
    text = str(refused.value) + (tmp_path / "tp1.log").read_text(errors="replace")
    assert "the shards are for L=2 ranks but vLLM's tensor-parallel size is 1" in text
    assert "serve them with --tensor-parallel-size 2" in text

"""Shared fixtures. Real-model fixtures load the packaged SmolLM2-135M once per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer, gguf path) of the real pretrained SmolLM2-135M-Instruct (dequantised, fp32)."""
    from models.assets import AssetNotFoundError, smollm2_gguf
    from models.loading import ModelSource, load_model, load_tokenizer

    try:
        path = smollm2_gguf()
    except AssetNotFoundError as exc:
        if os.environ.get("CI") == "true":
            raise
        pytest.skip(str(exc))
    source = ModelSource(str(path))
    return load_model(source, device="cpu"), load_tokenizer(source), Path(path)

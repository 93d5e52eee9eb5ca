from __future__ import annotations

import pytest
import torch

from tests.models.distill.kit import VOCAB
from tests.tiny import tiny_model


@pytest.fixture()
def setup():
    teacher = tiny_model("qwen3")
    g = torch.Generator().manual_seed(5)
    train = torch.randint(0, VOCAB, (12, 16), generator=g)  # [n, S]
    return teacher, train

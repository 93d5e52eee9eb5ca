"""The real SmolLM2-135M: an `optimise` export at L=3, δ=1 runs on three ranks and generates the
simulator's greedy text."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from app.cli.main import main
from models.io.assets import corpus_file
from models.runtime import DTPRuntime
from tests.models.runtime.reference import max_logit_error, simulator_generation

# ~2.5 min on 2 cores (an export and three ranks of the real model): `make test-long`; the tiny models'
# runtime parity tests (test_parity.py, test_schedules.py) check the same path in `make test`
pytestmark = [pytest.mark.real, pytest.mark.long]

PROMPT = "In the beginning God created the heaven and the earth. And the earth was"
NEW_TOKENS = 16


def test_smollm2_optimise_export_generates_the_simulators_greedy_text(smollm2, tmp_path):
    _, tokenizer, gguf = smollm2
    out = tmp_path / "run"
    assert main(["optimise", str(gguf), "--devices", "3", "--delta", "1", "--calib", str(corpus_file("shakespeare")),
                 "--calib-sequences", "2", "--calib-seq-len", "64", "--restarts", "0", "--out", str(out),
                 "--device", "cpu"]) == 0
    shards_dir = out / "shards"
    with DTPRuntime.start(shards_dir, backend="gloo", timeout_s=120.0) as rt:
        assert (rt.world_size, rt.info.layout, rt.info.delta) == (3, "optimised", 1)
        result = rt.generate_text(PROMPT, max_new_tokens=NEW_TOKENS, stop_at_eos=False, return_logits=True)
    ids = torch.as_tensor(tokenizer(PROMPT, return_tensors="np")["input_ids"])
    np.testing.assert_array_equal(result.prompt_ids, ids.numpy())
    prefill, steps, want = simulator_generation(shards_dir, ids, NEW_TOKENS - 1, 1)
    np.testing.assert_array_equal(result.tokens, want.numpy())
    assert result.text == [tokenizer.decode(want[0].tolist(), skip_special_tokens=True)]
    assert result.text[0].strip()  # real words, not an empty string
    # fp32 on CPU: the same arithmetic in a different order (batched vs per-rank matmuls, gloo's sums).
    assert max_logit_error(result, prefill, steps) < 1e-3

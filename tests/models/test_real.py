"""The real pretrained SmolLM2-135M (GGUF, dequantised): permutation invariance and evaluation."""

from __future__ import annotations

import json

import pytest
import torch

from app.cli import main
from models import layout as lay
from models.assets import corpus_file
from models.export import permuted_copy
from models.families import model_shape

pytestmark = pytest.mark.real


def test_smollm2_shape(smollm2):
    model, tokenizer, _ = smollm2
    shape = model_shape(model.config)
    assert (shape.num_layers, shape.num_kv_groups, shape.num_query_heads, shape.intermediate_size) == (
        30, 3, 9, 1536)
    assert tokenizer is not None


def test_smollm2_permutation_keeps_logits_at_L3(smollm2):
    model, tokenizer, _ = smollm2
    layout = lay.random(model_shape(model.config), 3, 1, seed=1000)
    permuted = permuted_copy(model, layout)
    ids = tokenizer("In the beginning God created the heaven and the earth.", return_tensors="pt").input_ids
    with torch.no_grad():
        torch.testing.assert_close(permuted(ids).logits, model(ids).logits, atol=1e-4, rtol=0)


def test_smollm2_eval_runs_on_kjv(smollm2, capsys):
    _, _, gguf = smollm2
    code = main(["eval", str(gguf), "--devices", "3", "--delta", "1", "--data", str(corpus_file("kjv")),
                 "--blocks", "2", "--seq-len", "128", "--json", "--device", "cpu"])
    assert code == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # A pretrained model on English text: dense perplexity far below the vocabulary size; DTP
    # without distillation is much worse, with a positive KL.
    assert 1.0 < result["dense_ppl"] < 100.0
    assert result["dtp_ppl"] > result["dense_ppl"]
    assert result["kl"] > 0.1

"""The real pretrained SmolLM2-135M (GGUF, dequantised): its converted copy, permutation invariance and
evaluation."""

from __future__ import annotations

import json

import pytest
import torch

from app.cli.main import main
from models.export.resident import permuted_copy
from models.families import model_shape
from models.io.assets import corpus_file
from models.layouts import layout as lay
from models.schedules.grammar import dtp_spec

pytestmark = pytest.mark.real


def test_smollm2_shape(smollm2):
    model, tokenizer, _ = smollm2
    shape = model_shape(model.config)
    assert (shape.num_layers, shape.num_kv_groups, shape.num_query_heads, shape.intermediate_size) == (
        30, 3, 9, 1536)
    assert tokenizer is not None


def test_smollm2_converted_equals_the_direct_load(smollm2):
    """The packaged SmolLM2-135M GGUF: weights, logits and token ids from the converted copy
    (models.io.converted) equal the direct load. The copy is made in the session's cache
    ($DTP_LAYOUT_CACHE_DIR, tests/conftest.py), where the CLI tests below then read it."""
    from models.io.converted import ConvertedCache
    from models.io.loading import ModelSource, load_model, load_tokenizer
    from tests.models.test_converted import assert_same_model

    direct, direct_tokenizer, gguf = smollm2
    cache = ConvertedCache()
    source = cache.converted_source(ModelSource(str(gguf)))
    model, tokenizer = load_model(source), load_tokenizer(source)
    text = "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer"
    assert tokenizer(text).input_ids == direct_tokenizer(text).input_ids
    assert tokenizer.eos_token_id == direct_tokenizer.eos_token_id
    assert_same_model(model, direct)
    assert cache.converted_source(ModelSource(str(gguf))) == source


def test_smollm2_permutation_keeps_logits_at_L3(smollm2):
    model, tokenizer, _ = smollm2
    layout = lay.random(model_shape(model.config), 3, 1, seed=1000)
    permuted = permuted_copy(model, layout)
    ids = tokenizer("In the beginning God created the heaven and the earth.", return_tensors="pt").input_ids
    with torch.no_grad():
        torch.testing.assert_close(permuted(ids).logits, model(ids).logits, atol=1e-4, rtol=0)


def test_smollm2_eval_runs_on_kjv(smollm2, capsys):
    _, _, gguf = smollm2
    code = main(["eval", str(gguf), "--devices", "3", "--delta", "1", "--data", str(corpus_file("shakespeare")),
                 "--blocks", "2", "--seq-len", "128", "--json", "--device", "cpu"])
    assert code == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # A pretrained model on English text: dense perplexity far below the vocabulary size; DTP
    # without distillation is much worse, with a positive KL.
    assert 1.0 < result["dense_ppl"] < 100.0
    assert result["dtp_ppl"] > result["dense_ppl"]
    assert result["kl"] > 0.1


def test_smollm2_optimise_end_to_end(smollm2, tmp_path, capsys):
    """`dtp-layout optimise` at L=3, δ=1 on 16 × 256 tokens of the KJV: the optimised layout beats
    contiguous and every random layout, is an exact fixed point, and its checkpoint keeps the logits."""
    import numpy as np
    from transformers import AutoModelForCausalLM

    from models.affinity.scoring import AffinityResult
    from models.layouts.layout import load
    from models.optimise import is_block_optimal
    from models.variants.set import affinity_for

    model, tokenizer, gguf = smollm2
    out = tmp_path / "run"
    code = main(["optimise", str(gguf), "--devices", "3", "--delta", "1", "--calib", str(corpus_file("shakespeare")),
                 "--calib-sequences", "16", "--calib-seq-len", "256", "--random", "4", "--out", str(out),
                 "--device", "cpu"])
    assert code == 0
    report = json.loads((out / "report.json").read_text())
    scores = {name: rep["J"] for name, rep in report["layouts"].items()}
    randoms = [v for k, v in scores.items() if k.startswith("random-")]
    assert len(randoms) == 4
    assert scores["optimised"] > scores["contiguous"]
    assert scores["optimised"] > max(randoms)
    assert scores["optimised"] <= report["upper_bound"] + 1e-9
    assert report["tokens"] == 16 * 256
    assert set(report["seconds"]) == {"loading", "calibration", "affinity", "optimising", "exporting"}

    affinity = affinity_for(AffinityResult.load(out / "affinity.safetensors"), "fo")
    best = load(out / "layouts" / "optimised.json")
    assert is_block_optimal(affinity, best.kv_group_device, best.neuron_device, devices=3)
    for up in affinity.up:
        assert np.isfinite(up).all() and up.sum() > 0

    permuted = AutoModelForCausalLM.from_pretrained(out / "checkpoint").eval()
    ids = tokenizer("And God said, Let there be light: and there was light.", return_tensors="pt").input_ids
    with torch.no_grad():
        torch.testing.assert_close(permuted(ids).logits, model(ids).logits, atol=1e-4, rtol=0)
    assert "optimised" in capsys.readouterr().out


def test_smollm2_distillation_reduces_the_kl(smollm2, tmp_path):
    """SmolLM2-135M at L=3, δ=1: a handful of distillation steps on Shakespeare lower the KL to the
    dense model on held-out Shakespeare, the blocks after the training ones (short sequences and a high
    learning rate, so that 4 steps show it)."""
    from models import distill
    from models.data.calibration import CalibrationSpec

    model, tokenizer, _ = smollm2
    recipe = distill.DistillRecipe(steps=4, batch_size=2, micro_batch_size=2, lr=2e-4, min_lr=2e-5, warmup_steps=1,
                                   eval_every=4, eval_batch_size=4, checkpoint_every=1)
    spec = distill.DistillSpec(layouts=("contiguous",), devices=3, delta=1, schedule=dtp_spec(1), recipe=recipe,
                               train=CalibrationSpec(str(corpus_file("shakespeare")), sequences=8, seq_len=64),
                               eval=CalibrationSpec(str(corpus_file("shakespeare")), sequences=4, seq_len=64))
    summary = distill.run_distill(spec, teacher=model, tokenizer=tokenizer, out_dir=tmp_path, model_id="smollm2",
                                  plot=False, keep_checkpoints=False)
    curve = summary["layouts"]["contiguous"]
    assert curve["steps"] == [0, 4]
    assert curve["kl"][0] > 1.0  # the untrained DTP model is far from the dense one
    assert curve["kl"][1] < 0.9 * curve["kl"][0]
    assert curve["ppl"][1] < curve["ppl"][0]
    assert 1.0 < summary["dense_ppl"] < 200.0
    assert not (tmp_path / "runs" / "contiguous" / "seed-0" / "checkpoint").exists()

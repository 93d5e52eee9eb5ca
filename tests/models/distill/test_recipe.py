"""The recipe: the paper's numbers, every field's rule, and no torch needed to use it."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from models import distill as D
from models.data.calibration import CalibrationSpec
from models.distill.recipe import EVAL_SEQUENCES, SEQ_LEN, WIKITEXT2_TEST, DistillError, DistillRecipe
from models.schedules.grammar import dtp_spec

REPO = Path(__file__).resolve().parents[3]
PAPER = REPO.parent / "shared" / "papers" / "000_3f90ffc866264473.txt"

# The paper's words (§4 "Training"/"Evaluation" and the appendix), and the literal values they state.
PAPER_RECIPE: list[tuple[str, dict[str, object]]] = [
    ("loss KL(teacher ∥ student) + 0.1 CE per token", {"ce_weight": 0.1}),
    ("AdamW (Loshchilov and Hutter, 2019) with β = (0.9, 0.95), no weight decay",
     {"betas": (0.9, 0.95), "weight_decay": 0.0}),
    ("learning rate 5 × 10−5 with 100 warm-up steps and cosine decay to 5 × 10−6",
     {"lr": 0.00005, "warmup_steps": 100, "min_lr": 0.000005}),
    ("gradient clipping at 1, embeddings frozen", {"grad_clip": 1.0, "freeze_embeddings": True}),
    ("Each step is 16 sequences of 1024 tokens", {"batch_size": 16}),
    ("micro-batch 4 with 4 accumulation steps", {"micro_batch_size": 4}),
    ("Short runs are 1000 steps", {"steps": 1000}),
    ("Every 100 steps (250 for the long runs)", {"eval_every": 100}),
]
PAPER_PROTOCOL = [
    "fp32 master weights with bf16 autocast",
    "16 blocks of 1024 tokens of the WikiText-2 test set",
    "64 sequences of 1024 tokens of FineWeb-Edu",
    "random layouts drawn with fixed seeds 1000 to 1007",
    "gradient checkpointing on",
]


def test_defaults_are_the_papers_recipe():
    recipe = DistillRecipe()
    for _, values in PAPER_RECIPE:
        for name, value in values.items():
            assert getattr(recipe, name) == value, name
    assert recipe.batch_size // recipe.micro_batch_size == 4  # "with 4 accumulation steps"
    # "fp32 master weights with bf16 autocast": bf16 on CUDA (on CPU, where bf16 is slow, fp32).
    assert recipe.use_bf16("cuda") and not recipe.use_bf16("cpu")
    # The data protocol: 16 sequences of 1024 tokens per step; evaluation on 16 blocks of 1024 tokens
    # of the WikiText-2 test set; calibration on 64 sequences of 1024 tokens; random seeds 1000…
    from models.layouts.names import RANDOM_SEED_BASE

    assert (SEQ_LEN, EVAL_SEQUENCES) == (1024, 16)
    assert re.fullmatch(r"hf:[^:]+/wikitext:wikitext-2-raw-v1:test", WIKITEXT2_TEST)
    assert (CalibrationSpec("x").sequences, CalibrationSpec("x").seq_len) == (64, 1024)
    assert RANDOM_SEED_BASE == 1000
    # The appendix ran with gradient checkpointing on: it trades compute for memory and leaves the
    # gradients unchanged (tests/models/distill/test_loss.py), so the default is off (faster on CPU).
    assert recipe.gradient_checkpointing is False


@pytest.mark.skipif(not PAPER.is_file(), reason="the paper text lives in ../shared (not on a user's clone)")
def test_the_quoted_words_are_the_papers():
    text = " ".join(PAPER.read_text().split())
    for quote in [q for q, _ in PAPER_RECIPE] + PAPER_PROTOCOL:
        assert quote in text, quote


def test_recipe_module_needs_no_torch():
    """The API process builds and checks recipes: models.distill and its recipe import without torch."""
    code = """
import sys
sys.modules["torch"] = None  # any `import torch` now raises ImportError
import models.distill
from models.distill import DistillRecipe, DistillError, learning_rate
from models.distill.recipe import WIKITEXT2_TEST
r = DistillRecipe.from_dict({"lr": 1e-4, "betas": [0.8, 0.9]})
assert r.betas == (0.8, 0.9) and DistillRecipe.from_dict(r.as_dict()) == r
assert learning_rate(0, r) == 1e-4 / 100
try:
    DistillRecipe(lr=float("nan"))
except DistillError as exc:
    print("refused:", exc)
print(sorted(m for m, mod in sys.modules.items()
             if mod is not None and m.split(".")[0] in ("torch", "transformers", "safetensors", "numpy")))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert lines[0].startswith("refused: recipe.lr must be a finite number > 0") and lines[-1] == "[]"


def test_recipe_validation():
    with pytest.raises(D.DistillError, match="multiple of micro_batch_size"):
        D.DistillRecipe(batch_size=6, micro_batch_size=4)
    with pytest.raises(D.DistillError, match="min_lr"):
        D.DistillRecipe(lr=1e-5, min_lr=1e-4)
    with pytest.raises(D.DistillError, match="steps"):
        D.DistillRecipe(steps=0)
    with pytest.raises(D.DistillError, match="unknown field"):
        D.DistillRecipe.from_dict({"lr": 1e-4, "learning_rate": 1})
    assert D.DistillRecipe.from_dict(D.DistillRecipe().as_dict()) == D.DistillRecipe()


@pytest.mark.parametrize(("fields", "message"), [
    ({"steps": 10_000_001}, r"recipe.steps must be an integer ≥ 1 and ≤ 10000000, got 10000001"),
    ({"steps": 10.0}, "recipe.steps must be an integer"),
    ({"steps": True}, "recipe.steps must be an integer"),
    ({"batch_size": 65_537, "micro_batch_size": 1}, "batch_size must be an integer ≥ 1 and ≤ 65536"),
    ({"lr": math.nan}, r"recipe.lr must be a finite number > 0"),
    ({"lr": math.inf, "min_lr": math.inf}, r"recipe.lr must be a finite number > 0"),
    ({"adam_eps": 0.0}, r"recipe.adam_eps must be a finite number > 0"),
    ({"weight_decay": math.nan}, r"recipe.weight_decay must be a finite number ≥ 0"),
    ({"grad_clip": -math.inf}, "recipe.grad_clip"),
    ({"ce_weight": "0.1"}, "recipe.ce_weight must be a finite number"),
    ({"betas": (0.9, math.nan)}, r"recipe.betas must be two numbers in \[0, 1\)"),
    ({"betas": "ab"}, "recipe.betas"),
    ({"betas": (0.9, 0.95, 0.99)}, "recipe.betas"),
    ({"freeze_embeddings": "yes"}, "recipe.freeze_embeddings must be true or false"),
    ({"autocast": "fp16"}, "recipe.autocast must be auto, bf16 or none, got 'fp16'"),
    ({"last_scale": "half"}, "recipe.last_scale must be sqrt or one"),
    ({"logit_chunk": 1 << 21}, "recipe.logit_chunk"),
])
def test_every_field_is_bounded(fields, message):
    with pytest.raises(DistillError, match=message):
        DistillRecipe.from_dict(fields)


def test_numbers_are_stored_as_the_recipe_types():
    r = DistillRecipe(lr=1, min_lr=1, weight_decay=0, betas=[0, 0])
    assert r.lr == 1.0 and isinstance(r.lr, float) and isinstance(r.weight_decay, float)
    assert r.betas == (0.0, 0.0) and all(isinstance(b, float) for b in r.betas)
    assert r == DistillRecipe(lr=1.0, min_lr=1.0, weight_decay=0.0, betas=(0.0, 0.0))


def test_every_field_has_a_rule_a_schema_can_use():
    rules = DistillRecipe.rules()
    assert list(rules) == list(DistillRecipe.__dataclass_fields__)
    assert all(rule.doc for rule in rules.values())
    assert rules["autocast"].choices == ("auto", "bf16", "none") and rules["steps"].le == 10_000_000
    for name, rule in rules.items():  # the defaults obey their own rules
        if rule.kind in ("int", "float"):
            assert rule.within(getattr(DistillRecipe(), name)), name


def test_spec_validation():
    spec = CalibrationSpec("x.npy", sequences=4, seq_len=8)
    with pytest.raises(D.DistillError, match="duplicates"):
        D.DistillSpec(layouts=("contiguous", "contiguous"), train=spec, eval=spec, devices=2, schedule=dtp_spec(1))
    with pytest.raises(D.DistillError, match="seeds"):
        D.DistillSpec(layouts=("contiguous",), train=spec, eval=spec, devices=2, schedule=dtp_spec(1), seeds=(1, 1))

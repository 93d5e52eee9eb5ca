"""The torch-free defaults (each family record's `config_defaults`, read by models.families.defaults)
against transformers itself: each family's config class fills in exactly the record's values, and the
parameter count the API's limit uses equals the count of the model transformers builds (on the meta
device: no memory) from configs that leave fields out, so that omitting `intermediate_size` (or any
other field) cannot slip a model past DTP_LAYOUT_MAX_MODEL_PARAMS."""

from __future__ import annotations

import pytest

from app.core.services.model_limits import upload_config_problems
from models.families import FAMILIES, find_family
from models.families.defaults import parameter_count, with_family_defaults
from tests.service_kit import make_settings

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

MODEL_TYPES = sorted(t for family in FAMILIES for t in family.model_types)


def built_parameters(config: dict) -> int:
    """Parameters of the model transformers builds from `config` (as a worker would load it), on meta."""
    cfg = transformers.AutoConfig.for_model(**config)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_the_table_is_what_each_config_class_fills_in(model_type):
    family = find_family(model_type)
    assert family is not None and family.config_defaults, model_type
    cls = getattr(transformers, family.hf_config_class)
    filled = cls()
    heads = 4  # the derived fields: given heads and width, what the class makes of an omitted kv/head_dim
    small = cls(hidden_size=64, num_attention_heads=heads)
    for key, value in family.config_defaults.items():
        if key == "num_key_value_heads" and value is None:
            assert small.num_key_value_heads == heads, model_type
        elif key == "head_dim" and value is None:
            assert getattr(small, "head_dim", None) in (None, 64 // heads), model_type
        else:
            assert getattr(filled, key) == value, (model_type, key, getattr(filled, key), value)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_every_alias_the_config_class_reads_is_declared(model_type):
    """The config class's attribute_map, read both ways: each key it also stores a defaulted field under."""
    family = find_family(model_type)
    cls = getattr(transformers, family.hf_config_class)
    want = {alias: field for a, b in cls.attribute_map.items() for alias, field in ((a, b), (b, a))
            if field in family.config_defaults}
    assert dict(family.config_aliases) == want


ALIASED = [(t, alias) for t in MODEL_TYPES for alias in find_family(t).config_aliases]


@pytest.mark.parametrize(("model_type", "alias"), ALIASED)
def test_a_field_given_under_its_alias_is_counted_as_given(model_type, alias):
    """qwen3_moe's num_experts saved as num_local_experts (transformers 5's save_pretrained): 4 experts, not
    the class default's 128."""
    config = {"model_type": model_type, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 100, "intermediate_size": 48, "moe_intermediate_size": 24,
              alias: 4}
    assert parameter_count(config) == built_parameters(config), with_family_defaults(config)


@pytest.mark.parametrize("model_type", sorted(t for family in FAMILIES if family.moe for t in family.model_types))
def test_a_config_json_the_installed_transformers_wrote_counts_every_expert(model_type, tmp_path):
    import json

    cfg = transformers.AutoConfig.for_model(model_type, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                            num_key_value_heads=2, vocab_size=100, intermediate_size=48,
                                            moe_intermediate_size=24, num_experts=4)
    cfg.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert parameter_count(config) == built_parameters(config), config


OMISSIONS = [
    # the bypass: the FFN width left out (transformers fills 11008, 14336 or 22016)
    {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 100},
    # the kv heads, head_dim, vocabulary and tying left out too
    {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 8, "intermediate_size": 96},
    # almost everything left out: the family's full-size default model
    {"num_hidden_layers": 1},
    # everything given, tied
    {"hidden_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
     "intermediate_size": 48, "vocab_size": 64, "tie_word_embeddings": True},
]


@pytest.mark.parametrize("model_type", MODEL_TYPES)
@pytest.mark.parametrize("given", OMISSIONS, ids=["no-ffn", "no-kv-vocab", "nearly-nothing", "all-tied"])
def test_the_estimate_is_the_count_of_the_model_the_worker_builds(model_type, given):
    config = {"model_type": model_type, **given}
    if model_type in ("qwen2", "qwen3") and "num_key_value_heads" not in given:
        # an omitted kv is 32 in these classes: give heads it divides, or the family refuses the config
        config["num_attention_heads"] = 32
    assert parameter_count(config) == built_parameters(config), with_family_defaults(config)


def test_an_omitted_ffn_width_no_longer_bypasses_the_parameter_limit(tmp_path):
    """The issue's 181-byte config under MAX_MODEL_PARAMS=10^6: refused, naming the limit."""
    config = {"model_type": "llama", "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
              "vocab_size": 256}
    settings = make_settings(tmp_path, max_model_params=10**6)
    assert built_parameters(config) > 10**6
    problems = upload_config_problems(config, settings=settings)
    assert problems and "DTP_LAYOUT_MAX_MODEL_PARAMS" in problems[0][1], problems

"""Every registered family (models.families.FAMILIES) is found by every consumer of its record: the lookup and
its refusals, transformers' classes, the parameter count and the memory plan (checked against the model
transformers builds, counted on the meta device: not against the record), the serving manifest, the vLLM
plugin's classes and registration, and the tiny models the parity tests run on. A new family registered
without one of these fails here, naming the family and the consumer."""

from __future__ import annotations

import ast
import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from models.export.serving_manifest import DTP_ARCHITECTURES, ServingError, hf_overrides, serving_fields
from models.families import FAMILIES, Family, family_for_config, find_family, supported_model_types
from models.families.defaults import parameter_count, with_family_defaults
from models.layouts.layout import contiguous
from models.schedules.grammar import resolve_schedule
from models.streaming.memory_plan import layer_params
from tests.models.serving.vllm_kit import REPO, VLLM_PYTHON, cpu_env
from tests.tiny import BASE, FAMILY_CASES, MOE_CASES

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

CASES = [(family, model_type) for family in FAMILIES for model_type in family.model_types]
IDS = [model_type for _, model_type in CASES]
SERVED = [family for family in FAMILIES if family.vllm is not None]  # the vLLM plugin's families


def tiny_config(model_type: str, **overrides: Any) -> Any:
    """A small full-attention config of `model_type` from transformers' own config class."""
    return transformers.AutoConfig.for_model(model_type, **{**BASE, "sliding_window": None, **overrides})


def built(config: Any) -> Any:
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


def test_the_registry_is_the_list_of_supported_model_types() -> None:
    assert supported_model_types() == sorted(IDS)
    assert len({f.name for f in FAMILIES}) == len(FAMILIES)


@pytest.mark.parametrize(("family", "model_type"), CASES, ids=IDS)
def test_lookup_and_refusals_find_the_family(family: Family, model_type: str) -> None:
    assert find_family(model_type) is family
    assert family_for_config(tiny_config(model_type)) is family


@pytest.mark.parametrize(("family", "model_type"), CASES, ids=IDS)
def test_the_transformers_classes_are_the_records(family: Family, model_type: str) -> None:
    config = tiny_config(model_type)
    assert type(config).__name__ == family.hf_config_class
    assert type(built(config)).__name__ == family.hf_class


@pytest.mark.parametrize(("family", "model_type"), CASES, ids=IDS)
def test_the_counts_read_the_records_biases_and_norms(family: Family, model_type: str) -> None:
    """One decoder layer as transformers builds it: the memory plan's layer and the API's parameter count
    (which fills in the record's defaults) both count what the family's q/k/v biases and q/k norms add."""
    config = tiny_config(model_type, head_dim=16)
    model = built(config)
    layer = model.model.layers[0]
    assert layer_params(config) == sum(p.numel() for p in layer.parameters()), family.name
    names = {n for n, _ in layer.named_parameters()}
    assert ("self_attn.q_proj.bias" in names) == family.qkv_bias
    assert ("self_attn.q_norm.weight" in names) == family.qk_norm
    given = {k: v for k, v in BASE.items() if k != "max_position_embeddings"}
    assert parameter_count({"model_type": model_type, **given, "head_dim": 16}) == sum(
        p.numel() for p in model.parameters())


@pytest.mark.parametrize(("family", "model_type"), CASES, ids=IDS)
def test_the_defaults_are_the_config_class_s(family: Family, model_type: str) -> None:
    filled = with_family_defaults({"model_type": model_type})
    assert filled.keys() >= set(family.config_defaults)
    cls = getattr(transformers, family.hf_config_class)()
    for key, value in family.config_defaults.items():
        if value is not None:  # None: derived by the class (tests/models/test_family_defaults.py)
            assert getattr(cls, key) == value, (family.name, key)


@pytest.mark.parametrize(("family", "model_type"), CASES, ids=IDS)
def test_the_serving_manifest_names_the_dtp_architecture(family: Family, model_type: str) -> None:
    """The manifest's architecture is the record's vLLM class; a family the plugin does not serve (vllm None)
    gets none, and a server asking for one is told which model types it can serve."""
    layout = contiguous(_shape(model_type), 2, 1)
    serving = serving_fields(model_type, family.name, layout, resolve_schedule("dtp:1", 2, 2))
    if family.vllm is None:
        assert model_type not in DTP_ARCHITECTURES and serving["architecture"] is None
        with pytest.raises(ServingError, match="has no DTP architecture; supported: "):
            hf_overrides(serving)
        return
    assert DTP_ARCHITECTURES[model_type] == family.vllm.dtp
    assert hf_overrides(serving)["architectures"] == [family.vllm.dtp]


def _shape(model_type: str) -> Any:
    from models.families import model_shape

    return model_shape(tiny_config(model_type, num_hidden_layers=2))


def _module_source(module: str) -> Path:
    return REPO.joinpath(*module.split(".")).with_suffix(".py")


def _plugin_module(module: str) -> tuple[dict[str, list[str]], list[str]]:
    """The top-level classes (name -> base names) and `__all__` of a plugin module, read from its source: vLLM,
    which it imports, is installed only in .venv-vllm."""
    tree = ast.parse(_module_source(module).read_text())
    classes = {node.name: [ast.unparse(b) for b in node.bases] for node in tree.body if isinstance(node, ast.ClassDef)}
    exports: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            exports = list(ast.literal_eval(node.value))
    return classes, exports


@pytest.mark.parametrize("family", SERVED, ids=[f.name for f in SERVED])
def test_the_plugin_module_defines_each_dtp_class(family: Family) -> None:
    """The class the plugin registers for the record (`vllm.class_path`) is defined and exported where it says."""
    assert family.vllm is not None
    path = _module_source(family.vllm.module)
    assert path.is_file(), f"{family.name}: vllm.module={family.vllm.module!r} has no source at {path}"
    classes, exports = _plugin_module(family.vllm.module)
    assert family.vllm.dtp in classes, f"{family.name}: no class {family.vllm.dtp} in {path}"
    assert family.vllm.dtp in exports, f"{family.name}: {family.vllm.dtp} not in {path}'s __all__"


@pytest.mark.parametrize("family", FAMILIES, ids=[f.name for f in FAMILIES])
def test_the_parity_tests_have_a_tiny_model_of_each_family(family: Family) -> None:
    """tests/tiny.py's cases drive the simulator, export and runtime parity tests over every family."""
    cases = {case["model_type"] for case in (MOE_CASES if family.moe is not None else FAMILY_CASES).values()}
    assert set(family.model_types) <= cases, f"add a case of {family.name} to tests/tiny.py FAMILY_CASES/MOE_CASES"


def _part(doc: str, opening: str, end: str) -> str:
    """The text of docs/`doc` from `opening` to the next `end`."""
    text = (REPO / "docs" / doc).read_text()
    start = text.index(opening)
    stop = text.find(end, start)
    return text[start:stop if stop > 0 else len(text)]


def test_the_docs_list_every_family() -> None:
    """docs/cli.md's list of supported model types is the registry's; docs/serving.md's section on what the
    vLLM plugin runs names every family it serves."""
    supported = _part("cli.md", "Supported model types:", "(")
    assert sorted(re.findall(r"`([a-z0-9_]+)`", supported)) == supported_model_types(), supported
    runs = _part("serving.md", "- **Families:**", "\n## ")
    missing = [f.name for f in SERVED if not re.search(rf"\b{re.escape(f.name)}\b", runs)]
    assert not missing, f"docs/serving.md's families of the plugin lack {missing}: {runs}"


VLLM_REGISTRATION = """
import importlib, json
from vllm import ModelRegistry
import models.serving.vllm as plugin
from models.families import FAMILIES
plugin.register()
archs = set(ModelRegistry.get_supported_archs())
print(json.dumps({f.name: [f.vllm.dtp in archs, f.vllm.replaces in archs,
                           hasattr(importlib.import_module(f.vllm.module), f.vllm.dtp)] for f in FAMILIES if f.vllm}))
"""


@pytest.mark.vllm
@pytest.mark.skipif(not (VLLM_PYTHON.parent.parent / ".installed-stamp").is_file(),
                    reason=f"{VLLM_PYTHON.parent.parent} is not installed: `make vllm-env` (docs/serving.md)")
def test_the_plugin_registers_every_family_with_vllm() -> None:
    """In .venv-vllm: the plugin's hook registers each record's DTP class, the class imports from the module the
    record names, and vLLM knows the architecture the record says it replaces (its own class for the family)."""
    done = subprocess.run([str(VLLM_PYTHON), "-c", VLLM_REGISTRATION], cwd=REPO, capture_output=True, text=True,
                          timeout=600, env=cpu_env())
    assert done.returncode == 0, done.stderr[-4000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found == {f.name: [True, True, True] for f in SERVED}

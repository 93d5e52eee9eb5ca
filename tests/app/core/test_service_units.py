"""Service pieces without servers: names under the roots, the job spec, settings, no torch in the API."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from typing import Any

import pytest
from pydantic import ValidationError

from app.core.schemas.jobs import ABLATION_LAYOUTS, CalibrationIn, DistillRecipeIn, JobSpec
from app.core.services.model_limits import check_config
from app.core.services.sources import SourceError, resolve_data, resolve_model, resolve_under
from app.core.settings import Settings


def test_resolve_under_refuses_escapes(tmp_path):
    root = tmp_path / "root"
    (root / "team").mkdir(parents=True)
    (root / "team" / "model").mkdir()
    (tmp_path / "outside").mkdir()
    (root / "out").symlink_to(tmp_path / "outside", target_is_directory=True)
    (root / "in").symlink_to(root / "team", target_is_directory=True)
    assert resolve_under(root, "team/model", "f", "x") == (root / "team" / "model").resolve()
    assert resolve_under(root, "in/model", "f", "x") == (root / "team" / "model").resolve()
    assert resolve_under(root, "missing", "f", "x") is None
    for bad in ("../x", "/etc", "~/x", "team/../../x", "team\\model", ".git", "team//model/", "a/./b", "", "x\x00"):
        with pytest.raises(SourceError):
            resolve_under(root, bad, "f", "x")
    with pytest.raises(SourceError, match="outside"):
        resolve_under(root, "out", "f", "x")


def test_resolve_model_local_gguf_and_hub(tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text("{}")
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    assert resolve_model(tmp_path, "ckpt").path == (tmp_path / "ckpt").resolve()
    assert resolve_model(tmp_path, "m.gguf").loader_args()["gguf_file"] is None
    hub = resolve_model(tmp_path, "owner/name", revision="v1.0")
    assert hub.hub_id == "owner/name" and hub.loader_args() == {"path_or_id": "owner/name", "revision": "v1.0",
                                                                "gguf_file": None}
    for bad, field in (("../owner", "model.id"), ("no spaces!", "model.id"), ("ckpt", "model.gguf_file")):
        with pytest.raises(SourceError) as err:
            resolve_model(tmp_path, bad, gguf_file="x.gguf" if bad == "ckpt" else None)
        assert err.value.field == field
    with pytest.raises(SourceError):
        resolve_model(tmp_path, "owner/name", revision="../main")


def test_resolve_data(tmp_path):
    (tmp_path / "ids.npy").write_bytes(b"")
    assert resolve_data(tmp_path, "corpus:kjv") == "corpus:kjv"
    assert resolve_data(tmp_path, "hf:Salesforce/wikitext:wikitext-2-raw-v1:train").startswith("hf:")
    assert resolve_data(tmp_path, "ids.npy") == str((tmp_path / "ids.npy").resolve())
    for bad in ("corpus:other", "hf:", "hf:text", "hf:wikitext", "/etc/passwd", "../ids.npy", "nope.npy"):
        with pytest.raises(SourceError):
            resolve_data(tmp_path, bad)


def test_check_config_uses_the_loaders_messages():
    config = {"model_type": "llama", "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 4,
              "intermediate_size": 96, "hidden_size": 48}
    assert check_config(config, devices=2, delta=1) == []
    problems = dict(check_config(config, devices=3, delta=1))
    assert "does not divide num_kv_groups=4" in problems["devices"]
    assert "model_type='gpt2' is not supported" in dict(check_config({**config, "model_type": "gpt2"},
                                                                      devices=2, delta=1))["model.id"]


def test_check_config_fits_the_schedule_to_the_model():
    config = {"model_type": "llama", "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 4,
              "intermediate_size": 96, "hidden_size": 48}
    assert check_config(config, devices=2, delta=1, schedule="pt:3") == []
    assert "D must be in 1 .. 3" in dict(check_config(config, devices=2, delta=1, schedule="pt:4"))["schedule"]
    assert "layers [5] do not exist" in dict(check_config(config, devices=2, delta=1, schedule="spd:1,5"))["schedule"]


def test_cached_hub_config_is_checked_at_submit(tmp_path, monkeypatch):
    """A hub model whose config.json sits in the HF cache is checked without downloading anything."""
    import json

    import huggingface_hub.constants as hub_constants

    from app.core.services.jobs import SpecError, check_spec

    snapshot = tmp_path / "hub" / "models--acme--tiny" / "snapshots" / "0123456789abcdef"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "num_hidden_layers": 2, "num_attention_heads": 6, "num_key_value_heads": 2,
        "intermediate_size": 64, "hidden_size": 48}))
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("0123456789abcdef")
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    settings = Settings(var_dir=tmp_path / "var")
    body = {"model": {"id": "acme/tiny", "revision": "main"}, "devices": 3,
            "calibration": {"source": "corpus:shakespeare"}}
    with pytest.raises(SpecError) as err:
        check_spec(settings=settings, spec=JobSpec.model_validate(body))
    assert err.value.problems[0][0] == "devices" and "valid L for this model: 1, 2" in err.value.problems[0][1]
    fp, found = check_spec(settings=settings, spec=JobSpec.model_validate({**body, "devices": 2}))
    assert found["config_checked"] is True and found["config"]["num_hidden_layers"] and len(fp) == 64
    _, unknown = check_spec(settings=settings, spec=JobSpec.model_validate({**body, "model": {"id": "acme/other"}}))
    assert unknown == {"config_checked": False, "config": None, "gguf": False}


def test_calibration_fields_match_models_calibration():
    from models.data.calibration import CalibrationSpec

    assert set(CalibrationIn.model_fields) == {f.name for f in dataclasses.fields(CalibrationSpec)}
    defaults = CalibrationSpec(source="corpus:kjv")
    assert CalibrationIn(source="corpus:kjv").model_dump() == dataclasses.asdict(defaults)


def test_job_spec_defaults_and_export_shorthand():
    spec = JobSpec.model_validate({"model": {"id": "x"}, "devices": 2, "calibration": {"source": "corpus:kjv"},
                                   "export": False})
    assert spec.delta == 1 and spec.score == "fo" and not spec.export.any and spec.distill is None


def test_layout_names_match_models_pipeline():
    from models.run.pipeline import ABLATIONS

    assert tuple(ABLATIONS) == ABLATION_LAYOUTS
    spec = JobSpec.model_validate({"model": {"id": "x"}, "devices": 2, "calibration": {"source": "corpus:kjv"},
                                   "random_layouts": 2, "ablations": True, "restarts": 0})
    # The paper's seven spread layouts (Table 3), in the order the optimiser builds them.
    spread = ["anti-optimised", "heads-only", "neurons-only", "add-score", "4-layers", "8-layers", "12-layers"]
    assert spec.layout_names() == ["optimised", *spread, "contiguous", "random-1000", "random-1001"]
    add = JobSpec.model_validate({"model": {"id": "x"}, "devices": 2, "calibration": {"source": "corpus:kjv"},
                                  "ablations": True, "score": "add"})
    assert add.layout_names() == ["optimised", *spread[:3], "fo-score", *spread[4:], "optimised-restarts-0",
                                  "contiguous"]


@pytest.mark.parametrize("fields", [
    {}, {"steps": 4, "batch_size": 2, "micro_batch_size": 1, "eval_every": 2}, {"lr": 1e-3, "min_lr": 1e-3},
    {"betas": [0.0, 0.999]}, {"grad_clip": 0.0, "warmup_steps": 0}, {"autocast": "bf16", "last_scale": "one"},
    {"steps": 0}, {"batch_size": 6}, {"micro_batch_size": 0}, {"lr": 1e-6}, {"min_lr": 0.0}, {"lr": -1.0},
    {"warmup_steps": -1}, {"betas": [0.9, 1.0]}, {"betas": [0.9]}, {"weight_decay": -0.1}, {"ce_weight": -1.0},
    {"grad_clip": -1.0}, {"autocast": "fp16"}, {"last_scale": "half"}, {"logit_chunk": 0}, {"eval_every": 0},
    {"eval_batch_size": 0}, {"checkpoint_every": 0}, {"unknown": 1},
])
def test_distill_recipe_validation_agrees_with_models_distill(fields):
    """A recipe the API accepts is one DistillRecipe accepts, and the other way round."""
    from models.distill import DistillRecipe
    try:
        DistillRecipe.from_dict(fields)
        engine_ok = True
    except (ValueError, TypeError):
        engine_ok = False
    try:
        DistillRecipeIn.model_validate(fields)
        api_ok = True
    except ValidationError:
        api_ok = False
    assert api_ok == engine_ok


def test_distill_data_defaults():
    spec = JobSpec.model_validate({"model": {"id": "x"}, "devices": 2,
                                   "calibration": {"source": "corpus:kjv", "seq_len": 128, "text_field": "body"},
                                   "distill": {"steps": 10, "recipe": {"batch_size": 4, "micro_batch_size": 2}}})
    assert spec.distill is not None
    train, evaluation = spec.distill.data_specs(spec.calibration)
    assert train == {"source": "corpus:kjv", "sequences": 40, "seq_len": 128, "text_field": "body", "skip_blocks": 0}
    assert evaluation == {**train, "sequences": 16}
    assert spec.distill.recipe_fields() == {"batch_size": 4, "micro_batch_size": 2, "steps": 10}
    assert JobSpec.model_validate(spec.model_dump(mode="json")) == spec  # what the worker reads back


def test_settings_from_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("DTP_LAYOUT_VAR_DIR", str(tmp_path))
    monkeypatch.setenv("DTP_LAYOUT_BROKER_URL", "redis://example:6379/1")
    monkeypatch.setenv("DTP_LAYOUT_API_KEYS", f"ci:sha256:{'a' * 64}, ops:sha256:{'b' * 64}:admin:tenant=team")
    s = Settings()
    assert s.database_url == f"sqlite:///{tmp_path / 'dtp-layout.db'}"
    assert s.broker_url == "redis://example:6379/1" and s.storage == tmp_path / "storage"
    assert s.key_entries() == [("ci", "a" * 64, False, "ci"), ("ops", "b" * 64, True, "team")]
    assert Settings(**{k.removeprefix("DTP_LAYOUT_").lower(): v
                       for k, v in s.worker_env().items()}).worker_env() == s.worker_env()
    for bad in ("nocolon", "ci:secret", f"ci:md5:{'a' * 64}", f"ci:sha256:{'a' * 64}:root", "c i:sha256:" + "a" * 64):
        monkeypatch.setenv("DTP_LAYOUT_API_KEYS", bad)
        with pytest.raises(ValueError, match=r"NAME:sha256:HEX|unknown flag"):
            Settings()


# String settings with a format of their own: a value each accepts that is not its default.
FORMATTED = {"api_keys": f"ci:sha256:{'c' * 64}:admin:tenant=team", "corpora": "kjv",
             "storage_url": "s3://bucket/prefix", "storage_quotas": "team=1000000", "max_memory": "2GiB"}


def _not_default(name: str, field: Any, tmp_path) -> Any:
    """A value for the setting that differs from its default and passes its bounds, from its type."""
    import types
    import typing
    from pathlib import Path

    if name in FORMATTED:
        return FORMATTED[name]
    kind, default = field.annotation, field.default
    if typing.get_origin(kind) in (typing.Union, types.UnionType):  # X | None: X
        kind = next(a for a in typing.get_args(kind) if a is not type(None))
    if typing.get_origin(kind) is typing.Literal:
        return next(option for option in typing.get_args(kind) if option != default)
    if kind is bool:
        return not default
    if kind is Path:
        return tmp_path / name
    if kind is str:
        return f"{name}-{default}-x"
    if kind in (int, float):
        upper = min((m.le for m in field.metadata if hasattr(m, "le")), default=None)
        lower = max((m.ge for m in field.metadata if getattr(m, "ge", None) is not None), default=None)
        value = (default or 0) + (1 if kind is int else 0.25)
        value = value if lower is None else max(value, lower)
        return value if upper is None or value <= upper else (default or 0) - 1
    raise AssertionError(f"setting {name}: no test value for its type {field.annotation!r}; add it here")


def test_worker_env_carries_every_setting_to_the_worker(tmp_path):
    """worker_env is derived from the fields: every setting, set to something other than its default,
    reads back the same in a fresh process started with only that environment (as a worker is)."""
    import json
    import os

    values = {name: _not_default(name, field, tmp_path) for name, field in Settings.model_fields.items()}
    settings = Settings(**values)
    expected = settings.model_dump(mode="json")
    for name, field in Settings.model_fields.items():
        assert getattr(settings, name) != field.default, name
    env = settings.worker_env()
    assert set(env) == {f"DTP_LAYOUT_{name.upper()}" for name in Settings.model_fields}
    clean = {k: v for k, v in os.environ.items() if not k.startswith("DTP_LAYOUT_")}
    out = subprocess.run([sys.executable, "-c", "from app.core.settings import Settings; "
                                               "print(Settings().model_dump_json())"],
                         env={**clean, **env}, capture_output=True, text=True, check=True, cwd=tmp_path,
                         timeout=60).stdout
    assert json.loads(out) == expected


def test_api_process_never_imports_torch(tmp_path):
    code = f"""
import sys
from fastapi.testclient import TestClient
from app.api.main import create_app
from app.core.migrate import upgrade
from app.core.settings import Settings
s = Settings(var_dir={str(tmp_path)!r})
upgrade(s.database_url)
with TestClient(create_app(s)) as c:
    assert c.get('/healthz').status_code == 200
    assert c.get('/v1/jobs').status_code == 200
    assert c.get('/v1/spec').status_code == 200  # the corpora, the data root and the defaults, torch-free
    assert c.post('/v1/jobs', json={{}}).status_code == 422
    bad = c.post('/v1/jobs', json={{'model': {{'id': 'x'}}, 'devices': 2, 'calibration': {{'source': 'corpus:kjv'}},
                                   'distill': {{'layouts': ['random-7'], 'recipe': {{'lr': 1e-3}}}}}})
    assert bad.status_code == 422 and 'distill.layouts.0' in bad.text, bad.text
    assert c.get('/v1/jobs/nope/metrics').status_code == 404
    assert c.get('/openapi.json').status_code == 200
    assert c.get('/readyz').status_code == 200  # the Celery client of app/core/queue.py
print(sorted(m for m in sys.modules if m == 'worker' or m.startswith('worker.')))  # the only arrow: worker → app
import app.cli.commands.service, app.cli.commands.keys, worker.celery_app
print(sorted(m for m in ('torch', 'transformers', 'safetensors') if m in sys.modules))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-2:] == ["[]", "[]"]


def test_service_commands_are_registered():
    from app.cli.main import build_parser

    parser = build_parser()
    args = parser.parse_args(["serve", "--host", "0.0.0.0", "--port", "9000"])
    assert args.host == "0.0.0.0" and args.port == 9000 and args.func.__name__ == "cmd_serve"
    assert parser.parse_args(["worker", "--gpus", "0,1"]).gpus == "0,1"


def test_export_dtype_is_a_bounded_choice_separate_from_the_compute_dtype():
    base = {"model": {"id": "x", "dtype": "bfloat16"}, "devices": 2, "calibration": {"source": "corpus:shakespeare"}}
    spec = JobSpec.model_validate(base)
    assert spec.export.dtype == "auto" and spec.model.dtype == "bfloat16"
    assert JobSpec.model_validate({**base, "export": {"dtype": "float32"}}).export.dtype == "float32"
    for bad in ("int8", "fp32", "", None, 1):
        with pytest.raises(ValidationError, match=r"export\.dtype"):
            JobSpec.model_validate({**base, "export": {"dtype": bad}})


def test_distill_overlap_flag_defaults_to_held_out():
    base = {"model": {"id": "x"}, "devices": 2, "calibration": {"source": "corpus:shakespeare"}}
    assert JobSpec.model_validate({**base, "distill": {}}).distill.allow_overlap is False
    assert JobSpec.model_validate({**base, "distill": {"allow_overlap": True}}).distill.allow_overlap is True
    with pytest.raises(ValidationError, match="allow_overlap"):
        JobSpec.model_validate({**base, "distill": {"allow_overlap": "yes"}})

"""What the server accepts of a model, checked from its config alone in constant time.

Dimensions are capped before anything else looks at them (a crafted config with 2^40 heads is a 422
in microseconds, not a loop; the valid device counts that `models.layouts.layout` lists are the divisors of
gcd(G, I), found in O(√gcd)), the parameter count estimated from the config is held under
DTP_LAYOUT_MAX_MODEL_PARAMS, and every sequence length of the job must fit the model's
`max_position_embeddings`. Every check reads the config the worker will build: the fields a config
leaves out take its family's defaults first (models.families.defaults), so omitting
`intermediate_size` is an 11,008-wide FFN here as in transformers, not a skipped check. The API runs
these checks at submit
when it can read the config without downloading weights; the worker runs the same checks before it
loads any weight (`app.core.hub.prepare_model`). Torch-free.
"""

from __future__ import annotations

from typing import Any, TypeGuard

from app.core.schemas.jobs import JobSpec
from app.core.settings import Settings
from models.families.defaults import parameter_count, with_family_defaults
from models.run.rules import RunFacts, job_schedule, memory_refusals, model_refusals

__all__ = ["check_config", "check_model_config", "dimension_problems", "parameter_count", "upload_config_problems"]

# The config fields a layout is computed from, and the largest value accepted for each (a documented
# limit: the largest public models are far below every one of these).
DIMENSION_LIMITS: dict[str, int] = {
    "num_hidden_layers": 1 << 16,
    "num_attention_heads": 1 << 16,
    "num_key_value_heads": 1 << 16,
    "head_dim": 1 << 16,
    "hidden_size": 1 << 20,
    "intermediate_size": 1 << 20,
    "vocab_size": 1 << 22,
    "max_position_embeddings": 1 << 40,
}


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def dimension_problems(config: dict[str, Any]) -> list[tuple[str, str]]:
    """Each present dimension must be an integer in [1, its limit]."""
    problems = []
    for key, cap in DIMENSION_LIMITS.items():
        value = config.get(key)
        if value is None:
            continue
        if not _is_int(value) or not 1 <= value <= cap:
            shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:40] + "…"
            problems.append(("model.id", f"the model's config has {key}={shown}; this server accepts integers "
                                         f"from 1 to {cap} (2^{cap.bit_length() - 1})"))
    return problems


def check_config(config: dict[str, Any], *, devices: int, delta: int, schedule: str | None = None,
                 facts: RunFacts | None = None) -> list[tuple[str, str]]:
    """(field, message) for every reason the job would fail its loading stage: the dimension limits,
    the family, then the rules that stage applies (models.run.rules.model_refusals). `facts`: the job's, where
    there is one (else L, δ and the schedule alone)."""
    from app.core.services.sources import config_namespace
    from models.families import family_for_config, model_shape

    config = with_family_defaults(config)
    if problems := dimension_problems(config):
        return problems
    ns = config_namespace(config)
    required = ("model_type", "num_hidden_layers", "num_attention_heads", "intermediate_size")
    if any(not isinstance(getattr(ns, key, None), int | str) for key in required):
        return []  # an unusual config: let the loader decide
    try:
        family_for_config(ns)
    except ValueError as exc:
        return [("model.id", str(exc))]
    try:
        shape = model_shape(ns)
    except (AttributeError, TypeError, ZeroDivisionError):
        return []
    if facts is None:
        facts = RunFacts(devices=devices, delta=delta, schedule=job_schedule(schedule, delta))
    return [(r.field, r.message) for r in model_refusals(facts, shape)]


def seq_len_problems(config: dict[str, Any], spec: JobSpec) -> list[tuple[str, str]]:
    """Every block of the job (calibration, distillation training and evaluation) within the model's
    context, when the config states it."""
    limit = config.get("max_position_embeddings")
    if not _is_int(limit):
        return []
    lengths = [("calibration.seq_len", spec.calibration.seq_len)]
    if spec.distill is not None:
        train, evaluation = spec.distill.data_specs(spec.calibration)
        lengths += [("distill.train.seq_len", train["seq_len"]), ("distill.eval.seq_len", evaluation["seq_len"])]
    return [(field, f"seq_len={n} is longer than the model's context (max_position_embeddings={limit})")
            for field, n in lengths if n > limit]


def too_many_parameters(params: int, settings: Settings) -> str:
    return (f"the model has {params:,} parameters (counted from its config, its family's defaults filling what it "
            f"leaves out); this server runs models of up to {settings.max_model_params:,} "
            "(DTP_LAYOUT_MAX_MODEL_PARAMS)")


def check_model_config(config: dict[str, Any], *, spec: JobSpec, settings: Settings) -> list[tuple[str, str]]:
    """Every reason this server refuses to run `spec` on a model with this config."""
    config = with_family_defaults(config)
    problems = check_config(config, devices=spec.devices, delta=spec.delta, facts=RunFacts.of_spec(spec))
    if any(field == "model.id" for field, _ in problems):
        return problems
    params = parameter_count(config)
    if params is not None and params > settings.max_model_params:
        problems.append(("model.id", too_many_parameters(params, settings)))
    return problems + seq_len_problems(config, spec) + memory_problems(config, spec=spec, settings=settings)


def memory_problems(config: dict[str, Any], *, spec: JobSpec, settings: Settings) -> list[tuple[str, str]]:
    """The job under its memory limit (its max_memory, else the worker's), by the rules its loading stage applies
    (models.run.rules.memory_refusals): it streams when the model would not fit; a job that cannot fit even
    streamed, or that streamed would distil, choose spd:auto's layers or score edges beyond the chain, is
    refused now, naming what it needs."""
    from app.core.services.sources import config_namespace
    from models.io.sizes import SizeError

    try:
        limit = settings.memory_limit(spec.max_memory)
    except SizeError as exc:
        return [("max_memory", str(exc))]
    if limit is None:
        return []
    try:
        _plan, refusals = memory_refusals(RunFacts.of_spec(spec), config_namespace(config), limit=limit)
    except (AttributeError, TypeError, ValueError, KeyError):
        return []  # an unusual config: the worker's own plan decides
    return [(r.field, r.message) for r in refusals]


def upload_config_problems(config: dict[str, Any], *, settings: Settings) -> list[tuple[str, str]]:
    """What check_model_config refuses of a model before any job names it (no devices or δ yet): the
    dimension limits, a family this server lays out, the parameter count."""
    from app.core.services.sources import config_namespace
    from models.families import family_for_config

    config = with_family_defaults(config)
    if problems := dimension_problems(config):
        return problems
    try:
        family_for_config(config_namespace(config))
    except (ValueError, AttributeError, TypeError) as exc:
        return [("model.id", str(exc))]
    params = parameter_count(config)
    if params is not None and params > settings.max_model_params:
        return [("model.id", too_many_parameters(params, settings))]
    return []

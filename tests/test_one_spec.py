"""One job spec (issue 21): every field declared in models/run/jobspec.py reaches the API's request schema, the
command lines of `optimise` and `distill` (where it applies), `dtp-layout client submit` and the dashboard's
form (through GET /v1/spec), with the same default; and a value given on a command line arrives at the
field's path. Torch-free: the command lines are parsed, not run; the API is the embedded SQLite one."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from app.api.main import create_app
from app.cli.args.spec_flags import command_flags, spec_values
from app.cli.client.commands import build_spec
from app.cli.main import build_parser
from app.core.migrate import upgrade
from app.core.schemas.jobs import JobSpec
from models.run.jobspec import FIELDS, GROUPS, SpecField, command_default
from tests import browser_kit
from tests.service_kit import ServeProcess, make_settings, provision

ROOT = Path(__file__).resolve().parent.parent
LOCAL_ARGV = {
    "optimise": ["optimise", "m", "-L", "2", "--calib", "c", "--out", "o"],
    "distill": ["distill", "m", "-L", "2", "--data", "d", "--out", "o"],
}
SUBMIT_ARGV = ["client", "submit", "--model", "m", "-L", "2", "--calib", "corpus:shakespeare"]
# a distillation block with its required sources, for the fields inside it
DISTILL_ARGV = ["--distill", "optimised,contiguous", "--train-data", "corpus:shakespeare", "--eval-data",
                "corpus:shakespeare"]
# Where a local command deliberately starts elsewhere than a service job (declared on the flag): a local
# distillation has no calibration to follow and evaluates on WikiText-2's test split, as the paper does.
LOCAL_DEFAULTS = {("distill", "distill.train.seq_len"), ("distill", "distill.eval.source"),
                  ("distill", "distill.eval.sequences")}


def _get(doc: Any, path: str) -> Any:
    for part in path.split("."):
        doc = doc[part]
    return doc


def _json(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def _other(field: SpecField) -> Any:
    """A valid value of the field that is not its default (within bounds and the recipe's cross rules)."""
    rule, default = field.rule, field.default
    special = {"model.revision": "v1.0", "model.gguf_file": "other.gguf", "model.id": "other-model", "devices": 3,
               "schedule": "pt:2", "max_memory": "2GiB", "probe": 3}  # probe 1 is refused (a probe compares ≥ 2)
    if field.path in special:
        return special[field.path]
    if rule.kind == "bool":
        return not default
    if rule.kind == "choice":
        return next(c for c in rule.choices if c != default)
    if rule.kind == "int":
        if default is None:
            return int(rule.ge or 0) + 2
        candidate = default * 2 if default * 2 != default else default + 1
        return candidate if rule.within(candidate) else int(rule.ge or 0)
    if rule.kind == "float":
        return default * 2 if default else 0.5
    if rule.kind == "betas":
        return [0.8, 0.9]
    if rule.kind == "list":
        return [1, 2] if rule.item is not None and rule.item.kind == "int" else ["contiguous"]
    return "corpus:kjv" if field.name == "source" else "body"


def _argv_value(value: Any) -> str:
    return ",".join(str(v) for v in value) if isinstance(value, list) else str(value)


def _flag_argv(flag: Any, value: Any) -> list[str]:
    if flag.form in ("on", "off"):
        return [flag.names[0]]
    return [_argv_value(value)] if flag.positional else [flag.names[0], _argv_value(value)]


# ---- the API ------------------------------------------------------------------------------------------

def _schema_node(schema: dict[str, Any], path: str) -> tuple[dict[str, Any], bool]:
    """The JSON schema of a dotted path in JobSpec's schema, and whether its model requires it."""
    defs = schema.get("$defs", {})
    node = schema
    required = False
    for part in path.split("."):
        while "$ref" in node or "anyOf" in node:  # a nested model, or `X | None`
            ref = node.get("$ref") or next((a["$ref"] for a in node.get("anyOf", []) if "$ref" in a), None)
            if ref is None:
                break
            node = defs[ref.rsplit("/", 1)[1]]
        required = part in node.get("required", [])
        node = node["properties"][part]
    return node, required


def _model_field(path: str) -> Any:
    """The pydantic FieldInfo of a dotted path of JobSpec."""
    model: Any = JobSpec
    *parents, leaf = path.split(".")
    for part in parents:
        annotation = model.model_fields[part].annotation
        model = next(a for a in (annotation, *getattr(annotation, "__args__", ())) if hasattr(a, "model_fields"))
    return model.model_fields[leaf]


def test_every_field_is_in_the_api_schema_with_its_default_and_bounds():
    schema = JobSpec.model_json_schema()
    for field in FIELDS:
        node, required = _schema_node(schema, field.path)
        assert required == field.required, field.path
        if not field.required and field.group != "distill.recipe":  # the recipe's: null, meaning its own
            # a list's default is a factory (a fresh list per request), which the schema does not show
            default = node["default"] if field.rule.kind != "list" else _model_field(field.path).get_default(
                call_default_factory=True)
            assert default == _json(field.default), field.path
        assert node["description"].startswith(field.rule.doc.split(" (default")[0][:40]), field.path
        for bound, key in (("ge", "minimum"), ("le", "maximum"), ("gt", "exclusiveMinimum")):
            value = getattr(field.rule, bound)
            if value is not None and field.rule.kind in ("int", "float"):
                options = [node, *node.get("anyOf", [])]
                assert any(o.get(key) == value for o in options), (field.path, bound)


def test_a_spec_that_leaves_the_fields_out_gets_the_declared_defaults():
    given = {"model": {"id": "m"}, "devices": 2, "calibration": {"source": "s"},
             "distill": {"train": {"source": "s"}, "eval": {"source": "s"}}}
    spec = JobSpec.model_validate(given)
    filled = spec.model_dump(mode="json")
    filled["distill"]["recipe"] = spec.distill.effective_recipe() if spec.distill else None
    filled["distill"]["recipe"]["betas"] = list(filled["distill"]["recipe"]["betas"])
    for field in FIELDS:
        if not field.required:
            assert _get(filled, field.path) == _json(field.default), field.path


# ---- the command lines --------------------------------------------------------------------------------

@pytest.mark.parametrize("command", sorted(LOCAL_ARGV))
def test_local_command_flags_default_to_the_declared_default(command):
    parser = build_parser()
    given = spec_values(parser.parse_args(LOCAL_ARGV[command]), command)
    flags = [(f, flag) for f, flag in command_flags(command) if isinstance(f, SpecField)]
    assert {f.path for f, _ in flags} == set(given), "a field's flag is not read back"
    for field, flag in flags:
        if field.required:
            continue
        expected = command_default(field, flag)
        assert _json(given[field.path]) == _json(expected), (command, field.path)
        assert (expected != field.default) == ((command, field.path) in LOCAL_DEFAULTS), (command, field.path)
    # the fields of the command's own work all have flags
    paths = {f.path for f, _ in flags}
    if command == "optimise":
        assert {f.path for f in FIELDS if "." not in f.path or f.group in ("model", "calibration")} <= paths
    else:
        assert {f.path for f in FIELDS if f.group.startswith("distill.") or f.path in (
            "distill.layouts", "distill.seeds", "distill.allow_overlap")} - {"distill.eval.skip_blocks"} <= paths


@pytest.mark.parametrize("command", sorted(LOCAL_ARGV))
def test_a_value_on_a_local_command_line_reaches_its_field(command):
    parser = build_parser()
    for field, flag in command_flags(command):
        if not isinstance(field, SpecField) or field.rule.kind == "betas":
            continue
        value = _other(field)
        argv = LOCAL_ARGV[command] + _flag_argv(flag, value)
        if flag.positional:
            argv = [command, _argv_value(value), *LOCAL_ARGV[command][2:]]
        assert spec_values(parser.parse_args(argv), command)[field.path] == value, (command, field.path)
    betas = spec_values(parser.parse_args([*LOCAL_ARGV["distill"], "--beta1", "0.8"]), "distill")
    assert betas["distill.recipe.betas"] == [0.8, 0.95]


def test_every_field_has_a_submit_flag_and_the_server_fills_in_the_declared_default():
    parser = build_parser()
    submit = {f.path: flag for f, flag in command_flags("submit") if isinstance(f, SpecField)}
    assert set(submit) == {f.path for f in FIELDS}
    sent = build_spec(parser.parse_args([*SUBMIT_ARGV, *DISTILL_ARGV]))
    assert set(sent) == {"model", "devices", "calibration", "distill"}  # nothing but what the flags say
    test_a_spec_that_leaves_the_fields_out_gets_the_declared_defaults()  # and the server fills the rest in


def test_a_value_given_to_submit_reaches_its_field():
    parser = build_parser()
    for field, flag in command_flags("submit"):
        if isinstance(field, SpecField):
            value = _other(field)
            sent = build_spec(parser.parse_args([*SUBMIT_ARGV, *DISTILL_ARGV, *_flag_argv(flag, value)]))
            spec = JobSpec.model_validate(sent).model_dump(mode="json")
            got = _get({**spec, "distill": {**spec["distill"], "recipe": {
                **JobSpec.model_validate(sent).distill.effective_recipe()}}}, field.path)  # type: ignore[union-attr]
            assert _json(got) == value, field.path
    # a block's off switch: the `export: false` shorthand
    [export] = [g for g in GROUPS if g.path == "export"]
    assert build_spec(parser.parse_args([*SUBMIT_ARGV, export.flags[0].names[0]]))["export"] is False


# ---- the form -----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def info(tmp_path_factory):
    settings = make_settings(tmp_path_factory.mktemp("one-spec"))
    provision(settings)
    upgrade(settings.database_url)
    with TestClient(create_app(settings)) as client:
        r = client.get("/v1/spec")
    assert r.status_code == 200, r.text
    return r.json()


def _flat(doc: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in doc.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def test_the_form_gets_every_field_with_the_declared_default(info):
    served = {f["path"]: f for f in info["fields"]}
    assert list(served) == [f.path for f in FIELDS]
    for field in FIELDS:
        entry = served[field.path]
        assert entry["required"] == field.required and entry["kind"] == field.rule.kind, field.path
        assert entry.get("default") == (None if field.required else _json(field.default)), field.path
        assert entry.get("choices") == (list(field.rule.choices) or None), field.path
    # the nested defaults the form shows as placeholders: the same values
    defaults = {**_flat(info["defaults"]), **_flat(info["distill_defaults"], "distill.")}
    for field in FIELDS:
        if field.path in defaults:
            assert defaults[field.path] == _json(field.default), field.path
    assert {f.path for f in FIELDS if not f.required and not f.group.startswith(("distill.train", "distill.eval"))} \
        <= set(defaults)


def test_the_form_lays_out_only_declared_fields():
    script = (ROOT / "app" / "ui" / "static" / "js" / "pages" / "submit.js").read_text()
    laid_out = set(re.findall(r'field\("([\w.]+)"', script)) - {"distill"}  # `distill`: the block's own switch
    assert laid_out and laid_out <= {f.path for f in FIELDS}, laid_out - {f.path for f in FIELDS}


# ---- the form in a browser ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """`dtp-layout serve --no-worker` (open, no keys): a refused job needs no worker."""
    serve = ServeProcess(tmp_path_factory.mktemp("one-spec-serve") / "var", no_worker=True)
    serve.start()
    yield serve
    serve.stop()


@pytest.fixture(scope="module")
def form_page(served):
    with browser_kit.playwright_or_skip() as playwright, browser_kit.browser_context(playwright) as context:
        page = context.new_page()
        page.goto(f"{served.url}/ui/submit")
        page.wait_for_selector("#submit-form #submit-job:enabled")  # GET /v1/spec has come
        yield page


@pytest.mark.browser
def test_the_form_draws_every_declared_field_once(form_page):
    drawn = form_page.eval_on_selector_all("[data-field]", "els => els.map(e => e.dataset.field)")
    assert len(drawn) == len(set(drawn)), drawn
    assert set(drawn) - {"distill"} == {f.path for f in FIELDS}  # `distill`: the block's own switch
    # a generated one by its kind: a choice is a select of its choices, left at the declared default
    [export_dtype] = [f for f in FIELDS if f.path == "export.dtype"]
    options = form_page.eval_on_selector_all("#f-export-dtype option", "os => os.map(o => o.value)")
    assert options == list(export_dtype.rule.choices)
    assert form_page.input_value("#f-export-dtype") == export_dtype.default


@pytest.mark.browser
def test_a_generated_field_is_sent_at_its_path_and_its_422_lands_next_to_it(form_page):
    posted: list[dict[str, Any]] = []
    form_page.on("request", lambda r: r.method == "POST" and r.url.endswith("/v1/jobs")
                 and posted.append(r.post_data_json))
    form_page.click("#more-fields summary")
    form_page.fill("#f-calibration-text_field", "body")
    form_page.check("#f-distill")
    form_page.click("#more-distill-fields summary")
    form_page.fill("#f-distill-recipe-adam_eps", "-1")  # the declared rule: > 0
    form_page.click("#submit-job")
    error = form_page.wait_for_selector("[data-error-for='distill.recipe.adam_eps']:not(:empty)")
    assert "greater than 0" in error.inner_text()
    assert form_page.text_content("[data-error-for='calibration.text_field']") == ""
    [body] = posted
    assert body["calibration"]["text_field"] == "body" and body["distill"]["recipe"]["adam_eps"] == -1
    # untouched generated fields are not sent: the server fills in their defaults
    assert "skip_blocks" not in body["calibration"] and "dtype" not in body["export"]
    assert "allow_overlap" not in body["distill"] and "autocast" not in body["distill"]["recipe"]

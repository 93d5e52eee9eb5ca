"""Issue 30, "the first hour, third round": the command line as a new user meets it. Each test fails on the
code before the fix it names: a refused command line names the flag and what is accepted, every argument
that can be checked without the model is checked before it loads, a refused run leaves nothing behind,
and the local commands' help speaks of local use."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from app.cli.client import build_spec
from app.cli.main import build_parser, main
from app.cli.spec_flags import path_flag_name
from models.jobspec import FIELDS

REPO = Path(__file__).resolve().parents[3]


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """main(argv) must exit 2 (argparse's SystemExit or the returned status); its stderr."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2, err
    return err


# ---- item 4: unknown flags name the closest one, in the subcommand's own error; the path-named spelling ----

@pytest.mark.parametrize("argv, prog, wrong, closest", [
    (["client", "submit", "--model", "m", "--calib-sed", "7"], "dtp-layout client submit", "--calib-sed",
     "--calib-seed"),
    (["eval", "m", "--devices", "2", "--data", "x", "--blokcs", "4"], "dtp-layout eval", "--blokcs", "--blocks"),
    (["optimise", "m", "--devcies", "3", "--calib", "x", "--out", "o"], "dtp-layout optimise", "--devcies",
     "--devices"),  # a mistyped required flag: named beside "required"
])
def test_an_unknown_flag_is_refused_by_its_subcommand_naming_the_closest(argv, prog, wrong, closest, capsys):
    err = _refused(argv, capsys)
    assert f"{prog}: error:" in err
    assert f"{wrong} (did you mean {closest}?)" in err
    assert "{export,eval" not in err  # the subcommand's usage, not the top-level one


def test_submit_takes_every_field_under_its_path_named_flag():
    parser = build_parser()
    for field in FIELDS:
        flag = path_flag_name(field)
        value = [] if field.rule.kind == "bool" else [_a_value(field.rule)]
        args = parser.parse_args(["client", "submit", flag, *value])
        assert field.path in _paths(build_spec(args)), (flag, build_spec(args))


def test_the_declared_and_the_path_named_spelling_set_the_same_field():
    parser = build_parser()
    short = build_spec(parser.parse_args(["client", "submit", "--calib-seed", "7"]))
    long = build_spec(parser.parse_args(["client", "submit", "--calibration-seed", "7"]))
    assert short == long == {"calibration": {"seed": 7}}


def test_the_flags_docs_ci_names_as_its_rule_are_submit_flags():
    row = next(line for line in (REPO / "docs" / "ci.md").read_text().splitlines() if "named after its path" in line)
    named = re.findall(r"`(--[a-z-]+)", row)
    assert "--calibration-seed" in named and "--calibration-text-field" in named
    submit = next(a for a in build_parser()._actions if a.dest == "command").choices["client"]
    submit = next(a for a in submit._actions if a.dest == "client_command").choices["submit"]
    known = {option for action in submit._actions for option in action.option_strings}
    assert set(named) - {"--wait", "--timeout"} <= known, set(named) - known


def _a_value(rule) -> str:
    """A value of the rule's kind, as a command line spells it."""
    if rule.kind == "betas":
        return "0.9,0.95"
    if rule.kind == "list":
        return _a_value(rule.item)
    if rule.kind == "choice":
        return rule.choices[0]
    return "1" if rule.kind in ("int", "float") else "a"


def _paths(spec: dict, prefix: str = "") -> set[str]:
    out = set()
    for key, value in spec.items():
        path = f"{prefix}{key}"
        out |= _paths(value, f"{path}.") if isinstance(value, dict) else {path}
    return out

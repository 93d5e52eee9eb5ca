"""The accepted schedules are listed from the preset registry (issue 43): every error, help string and the
job-spec schema shows the presets' own forms, so that a new preset shows wherever the others do; and a
preset declared layout-free (an objective refuses it) is one whose table leaves nothing to optimise."""

from __future__ import annotations

import argparse

import pytest

from models.schedules.grammar import ACCEPTED, ACCEPTED_WITHOUT_AUTO, accepted_forms, parse_schedule
from models.schedules.presets import _PRESETS, LAYOUT_FREE


def _help(parser: argparse.ArgumentParser, *path: str, flag: str = "--schedule") -> str:
    """The help of `flag` on the subcommand `path` of `parser`."""
    for name in path:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[name]
    return str(parser._option_string_actions[flag].help)


def test_every_form_of_every_preset_is_in_the_accepted_lists():
    forms = [form for preset in _PRESETS for form in preset.forms]
    assert ACCEPTED.startswith(", ".join(forms))
    for preset in _PRESETS:
        for form in preset.forms:
            assert (form in ACCEPTED_WITHOUT_AUTO) == (preset.kind != "spd-auto"), form
    # each form names a string the grammar takes, once its letters are numbers
    for form in forms:
        example = form.split(" ", 1)[0].replace("δ", "1").replace("K", "2").replace("D", "2").replace("B", "0,1")
        assert parse_schedule(example).kind in {p.kind for p in _PRESETS}, form


def test_the_help_strings_and_the_schema_list_the_registry():
    from app.cli.main import build_parser
    from models.run.jobspec import BY_PATH
    from models.runtime.cli import add_arguments

    parser = build_parser()
    every, without_auto = accepted_forms(sep=" | "), accepted_forms(sep=" | ", auto=False)
    assert every in BY_PATH["schedule"].rule.doc  # the job spec: the API schema, `submit --schedule`, the docs
    for command in ("distill", "export", "eval"):
        assert without_auto in _help(parser, command), command
    assert every in _help(parser, "optimise")
    objective = accepted_forms(sep=" | ", without=LAYOUT_FREE)
    assert objective in _help(parser, "layout")  # the optimiser on a saved affinity: an objective to optimise
    runtime = argparse.ArgumentParser()
    add_arguments(runtime)  # `python -m models.runtime` (and `dtp-layout generate`)
    assert accepted_forms(auto=False) in _help(runtime)


# spd:auto:K has no table until its layers are chosen (it becomes an spd:B, checked here)
@pytest.mark.parametrize("preset", [p for p in _PRESETS if p.kind != "spd-auto"], ids=lambda p: p.kind)
def test_layout_free_is_what_the_table_says(preset):
    example = {"tp": "tp", "ladder": "ladder", "dtp": "dtp:1", "spd": "spd:0", "pt": "pt:1"}[preset.kind]
    table = parse_schedule(example).resolve(num_layers=3, devices=2)
    assert table.layout_independent == preset.layout_free == (preset.kind in LAYOUT_FREE)

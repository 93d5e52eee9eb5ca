"""Issue 30, "the first hour, third round": the command line as a new user meets it. Each test fails on the
code before the fix it names: a refused command line names the flag and what is accepted, every argument
that can be checked without the model is checked before it loads, a refused run leaves nothing behind,
and the local commands' help speaks of local use."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from app.cli.args.spec_flags import path_flag_name
from app.cli.client.commands import build_spec
from app.cli.main import build_parser, main
from models.run.jobspec import FIELDS

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


# ---- item 6: every argument that needs no model is checked before the model loads, in every command ----
# The model named is one whose load would fail (a directory with no config), so a check made after the load
# would report the model, not the flag: the message proves the order, the timing that no model was read.

@pytest.fixture()
def no_model(tmp_path: Path) -> str:
    (tmp_path / "model").mkdir()
    return str(tmp_path / "model")


@pytest.mark.parametrize("command, flag, message", [
    (["eval", "MODEL", "--devices", "-3", "--data", "corpus:shakespeare"], "--devices", "--devices/-L -3: must be ≥ 1"),
    (["eval", "MODEL", "-L", "0", "--data", "corpus:shakespeare"], "--devices", "--devices/-L 0: must be ≥ 1"),
    (["eval", "MODEL", "-L", "2", "--data", "corpus:shakespeare", "--layout", "random:abc"], "--layout",
     "--layout random:abc: layout 'random:abc': expected random:SEED"),
    (["eval", "MODEL", "-L", "2", "--data", "corpus:nosuch"], "--data", "--data corpus:nosuch: unknown corpus"),
    (["eval", "MODEL", "-L", "2", "--data", "no/such/file.txt"], "--data", "no such file or directory"),
    (["eval", "MODEL", "-L", "2", "--data", "corpus:shakespeare", "--blocks", "0"], "--blocks", "--blocks 0"),
    (["optimise", "MODEL", "-L", "2", "--calib", "corpus:nosuch", "--out", "OUT"], "--calib",
     "--calib corpus:nosuch: unknown corpus"),
    (["optimise", "MODEL", "-L", "2", "--calib", "corpus:shakespeare", "--calib-seq-len", "1", "--out", "OUT"],
     "--calib-seq-len", "--calib-seq-len 1: must be ≥ 2"),
    (["export", "MODEL", "-L", "2", "--layout", "optimised", "--out", "OUT"], "--layout", "--from DIR"),
    (["export", "MODEL", "-L", "2", "--max-memory", "lots", "--out", "OUT"], "--max-memory", "--max-memory lots"),
    (["distill", "MODEL", "-L", "2", "--data", "corpus:nosuch", "--out", "OUT"], "--data", "unknown corpus"),
    (["distill", "MODEL", "-L", "2", "--data", "corpus:shakespeare", "--seeds", "-1", "--out", "OUT"], "--seeds",
     "--seeds -1: must be ≥ 0"),
    (["demo", "--seq-len", "1"], "--seq-len", "--seq-len 1: must be ≥ 2"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_arguments_are_refused_before_the_model_loads(command, flag, message, no_model, tmp_path, capsys):
    argv = [no_model if a == "MODEL" else str(tmp_path / "out") if a == "OUT" else a for a in command]
    err = _refused(argv, capsys)
    assert message in err and f"dtp-layout {command[0]}: error:" in err, err
    assert "loading" not in err and "config.json" not in err  # nothing of the model was read
    assert not (tmp_path / "out").exists()


@pytest.mark.serial  # a wall-time bound (< 8 s)
def test_eval_refuses_a_bad_argument_in_a_second_not_after_the_load(tmp_path):
    """Measured through the real command on the packaged model: the load alone takes 9–15 s."""
    import subprocess
    import sys
    import time

    from models.io.assets import smollm2_gguf

    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "app.cli", "eval", str(smollm2_gguf()), "--devices", "-3",
                           "--data", "corpus:shakespeare"], capture_output=True, text=True, timeout=120)
    took = time.monotonic() - t0
    assert proc.returncode == 2 and "--devices/-L -3: must be ≥ 1" in proc.stderr, proc.stderr
    assert "loading" not in proc.stderr and took < 8, took


# ---- item 11: a schedule error lists what this command accepts ----

def test_a_bad_schedule_lists_spd_auto_only_where_the_command_takes_it(no_model, tmp_path, capsys):
    err = _refused(["eval", no_model, "-L", "2", "--data", "corpus:shakespeare", "--schedule", "dtp:x"], capsys)
    assert "accepted: " in err and "spd:B" in err and "spd:auto" not in err
    err = _refused(["optimise", no_model, "-L", "2", "--calib", "corpus:shakespeare", "--schedule", "dtp:x",
                    "--out", str(tmp_path / "o")], capsys)
    assert "spd:auto:K" in err


# ---- item 5: a refused run leaves nothing that blocks the corrected rerun ----

def test_a_run_refused_in_its_first_stage_leaves_nothing_and_the_corrected_rerun_runs(tmp_path, capsys):
    """The calibration text is too short for the blocks asked: refused after the (tiny) model loaded, in the
    calibration stage; then the corrected rerun into the same --out runs without --overwrite."""
    import numpy as np

    from tests.tiny import tiny_model

    model = tmp_path / "model"
    tiny_model("qwen2").save_pretrained(model)
    short, enough = tmp_path / "short.npy", tmp_path / "enough.npy"
    np.save(short, np.arange(40) % 97)
    np.save(enough, np.random.default_rng(0).integers(0, 97, size=4 * 32))
    out = tmp_path / "run"
    argv = ["optimise", str(model), "-L", "2", "--calib-sequences", "4", "--calib-seq-len", "32", "--no-export",
            "--device", "cpu", "--out", str(out), "--calib"]
    err = _refused([*argv, str(short)], capsys)
    assert "token" in err, err
    assert not (out / "run.json").exists() and not out.exists()
    assert main([*argv, str(enough)]) == 0, capsys.readouterr().err
    assert (out / "report.json").is_file()


def test_a_run_record_with_no_stage_done_does_not_refuse_other_parameters(tmp_path, capsys):
    """What a refused run of an earlier version left behind: run.json with its parameters and no stage."""
    import argparse

    from app.cli.commands.optimise import _run_record
    from models.run.runner import RunRecord

    RunRecord(tmp_path, {"calibration": {"source": "corpus:nosuch"}}).save()
    args = argparse.Namespace(overwrite=False, no_export=True)
    record = _run_record(args, tmp_path, {"calibration": {"source": "corpus:shakespeare"}})
    assert record.stages == {}


# ---- item 7: the local commands' help speaks of local use ----

SERVICE_WORDS = ("refused at submit", "POST /v1", "server's", "null:", "tenant", "the worker's", "upload:ID")


@pytest.mark.parametrize("command", ["optimise", "eval", "export", "distill", "demo", "layout", "score", "generate"])
def test_a_local_commands_help_speaks_of_local_use(command):
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices[command]
    text = " ".join(sub.format_help().split())
    assert [word for word in SERVICE_WORDS if word in text] == []


def test_optimise_help_says_a_local_file_works_for_calib():
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices["optimise"]
    calib = next(a for a in sub._actions if "--calib" in a.option_strings)
    assert "a local .txt file" in calib.help and "corpus:shakespeare" in calib.help


# ---- item 2: the worker-extra message's advice works (dtp-layout is on no public index) ----

def test_the_worker_extra_message_names_an_install_that_works_from_here():
    import tomllib

    from app.cli.extras import worker_extra_message

    message = worker_extra_message(["torch"])
    assert f"pip install -e '.[worker]' in the checkout ({REPO})" in message
    assert "pip install 'dtp-layout[worker]'" not in message  # no index has it
    assert "worker" in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]


# ---- item 13: no "`torch_dtype` is deprecated" from reading a config without a dtype (a GGUF's) ----

def test_the_source_dtype_of_a_config_without_one_reads_no_deprecated_attribute():
    import torch
    from transformers import LlamaConfig

    from models.export.files import export_dtype, source_dtype

    class NoDeprecatedRead(LlamaConfig):
        @property
        def torch_dtype(self):  # what transformers 5 turns into a warning; reading it at all is the bug
            raise AssertionError("config.torch_dtype read")

    config = NoDeprecatedRead()
    config.dtype = None  # a GGUF's config: quantised weights have no dtype of their own
    assert source_dtype(config) is None
    assert export_dtype("auto", config=config, compute=torch.float32) == torch.float32
    config.dtype = torch.bfloat16
    assert source_dtype(config) == torch.bfloat16

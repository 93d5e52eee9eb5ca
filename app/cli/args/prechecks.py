"""Every argument of a model command that can be checked without the model, checked before it loads.

Loading SmolLM2-135M takes 9–15 s (and a larger model minutes): a command line that names a negative L, a
corpus that is not installed or a malformed layout must be refused at once, naming the flag and what it
accepts, never after the load. `main` runs `precheck` before every command that sets it (`export`, `eval`,
`optimise`, `distill`, `demo`); what needs the model's config (L against its KV groups, δ against its
layers) is checked by the commands themselves once the config is read, still before the weights.
Torch-free: nothing here imports torch, transformers or numpy.
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path
from typing import Any

from app.cli.args.model import layouts_dir_of
from app.cli.args.schedule import schedule_of
from app.cli.args.spec_flags import command_flags
from app.cli.errors import CliError
from models.base.fields import FieldRule, Flag
from models.data.source import parse_data_source
from models.run.jobspec import SpecField

# The command's own numeric flags that are not job-spec fields: name -> the least value accepted.
OWN_MINIMUMS: dict[str, dict[str, int]] = {
    "eval": {"blocks": 1, "seq_len": 2, "batch_size": 1},
    "demo": {"blocks": 1, "seq_len": 2},
}
# The data flags (dest) of each command: a local file or directory, corpus:NAME or hf:OWNER/NAME.
DATA_FLAGS: dict[str, tuple[str, ...]] = {
    "optimise": ("calib",),
    "eval": ("data",),
    "distill": ("data", "eval_data"),
}
LOCAL_DATA = "a local .txt/.jsonl/.npy file, a directory of .txt files, corpus:NAME or hf:OWNER/NAME[:CONFIG[:SPLIT]]"


def precheck(args: argparse.Namespace, command: str) -> None:
    """Refuse (CliError, exit 2) what the command line gets wrong that no model is needed to see."""
    check_schedule(args, command)  # first: a dtp schedule sets --delta
    check_spec_bounds(args, command)
    check_own_minimums(args, command)
    check_max_memory(args)
    check_layouts(args)
    for dest in DATA_FLAGS.get(command, ()):
        if getattr(args, dest, None) is not None:
            check_data_source(f"--{dest.replace('_', '-')}", getattr(args, dest))


def check_schedule(args: argparse.Namespace, command: str) -> None:
    """--schedule parsed; spd:auto:K only where the command chooses its layers (`optimise`)."""
    if getattr(args, "schedule", None) is not None and command != "demo":
        schedule_of(args, allow_auto=command == "optimise")


def check_spec_bounds(args: argparse.Namespace, command: str) -> None:
    """Each number of a job-spec flag within its field's bounds (models/run/jobspec.py): `--devices -3`."""
    if command == "demo":
        return
    for item, flag in command_flags(command):
        if not isinstance(item, SpecField) or flag.form in ("on", "off"):
            continue
        value = getattr(args, flag.dest, None)
        if value is None:
            continue
        rule = item.rule.item if flag.form == "csv" and item.rule.item is not None else item.rule
        for number in _numbers(value, flag, rule):
            if not rule.within(number):
                raise CliError(f"{'/'.join(flag.names)} {value}: must be {rule.bounds_text()}")


def _numbers(value: Any, flag: Flag, rule: FieldRule) -> list[float]:
    if rule.kind not in ("int", "float") or not rule.bounds_text():
        return []
    if flag.form == "csv":  # checked item by item where the items parse; spec_values reports the others
        try:
            return [float(x) for x in str(value).split(",") if x.strip()]
        except ValueError:
            return []
    return [value] if isinstance(value, int | float) else []


def check_own_minimums(args: argparse.Namespace, command: str) -> None:
    for dest, least in OWN_MINIMUMS.get(command, {}).items():
        value = getattr(args, dest, None)
        if value is not None and value < least:
            raise CliError(f"--{dest.replace('_', '-')} {value}: must be ≥ {least}")


def check_max_memory(args: argparse.Namespace) -> None:
    from models.io.sizes import SizeError, parse_size

    text = getattr(args, "max_memory", None)
    if text is None:
        return
    try:
        parse_size(text)
    except (SizeError, ValueError) as exc:
        raise CliError(f"--max-memory {text}: {exc}") from exc


def check_layouts(args: argparse.Namespace) -> None:
    """--from DIR has layouts/; --layout (eval, export) is a layout name this run can resolve: contiguous,
    random:SEED, a name under --from DIR, or a layout file. distill's --layouts are resolved by the command
    against the config, before the weights."""
    from models.layouts.resolve import check_layout_name

    layouts_dir = layouts_dir_of(args)
    if getattr(args, "layout", None) is not None:
        try:
            check_layout_name(args.layout, layouts_dir=layouts_dir)
        except ValueError as exc:  # LayoutError
            raise CliError(f"--layout {args.layout}: {exc}") from exc


def check_data_source(flag: str, source: str) -> None:
    """A data flag's source exists on this machine: the corpus is installed, the file or directory is there,
    hf: sources have `datasets`. (An upload:ID is the service's: a local command reads local files.)"""
    parsed = parse_data_source(source)
    if parsed.kind == "corpus":
        _check_corpus(flag, parsed.value)
    elif parsed.kind == "hf":
        if importlib.util.find_spec("datasets") is None:
            raise CliError(f"{flag} {source}: hf: sources need the `datasets` package (the hf extra: "
                           "pip install -e '.[hf]' in a checkout), or give a local file or corpus:NAME")
    elif not Path(source).exists():
        raise CliError(f"{flag} {source}: no such file or directory; expected {LOCAL_DATA}")
    elif Path(source).is_dir() and not any(Path(source).rglob("*.txt")):
        raise CliError(f"{flag} {source}: directory has no .txt files; expected {LOCAL_DATA}")


def _check_corpus(flag: str, name: str) -> None:
    from models.io.assets import CORPORA, AssetNotFoundError, available_corpora, corpus_available, corpus_file

    if corpus_available(name):
        return
    try:
        corpus_file(name)  # raises, saying what is missing
    except AssetNotFoundError as exc:
        installed = ", ".join(f"corpus:{n}" for n in available_corpora()) or "none"
        known = "" if name not in CORPORA else f" (installed here: {installed})"  # else the error lists them
        raise CliError(f"{flag} corpus:{name}: {exc}{known}") from exc

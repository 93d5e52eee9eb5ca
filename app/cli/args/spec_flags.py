"""The command-line flags of the job spec's fields, generated from their one declaration (models/run/jobspec.py):
`dtp-layout optimise`, `distill`, `export`, `eval` and `dtp-layout client submit` add them with
`add_spec_flags` and read them back, as dotted spec paths, with `spec_values`.

A local command's flag defaults to the field's default (or the command's own, where the declaration gives
one) and a required field's flag is required. `client submit` sends only what is given, so its flags
default to nothing and the server applies its defaults; every field has a submit flag named after its
path, `--PATH` (`--calibration-seed`, `--distill-recipe-min-lr`; a boolean that defaults to true: `--no-PATH`),
and a field that declares a shorter one takes both (`--calib-seed` and `--calibration-seed`). Torch-free.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from models.base.fields import NO_DEFAULT, Command, Flag
from models.run.jobspec import FIELDS, GROUP_BY_PATH, GROUPS, SpecField, SpecGroup, command_default

SUBMIT: Command = "submit"


def path_flag_name(field: SpecField) -> str:
    """The option named after the field's path: `--calibration-seed`, `--no-export-checkpoint` (a boolean
    that defaults to true)."""
    name = field.path.replace(".", "-").replace("_", "-")
    return f"--no-{name}" if field.rule.kind == "bool" and field.default is True else f"--{name}"


def generated_submit_flag(field: SpecField) -> Flag:
    """The submit flag of a field that declares none: its path as an option."""
    name = path_flag_name(field)
    if field.rule.kind == "bool":
        return Flag((name,), (SUBMIT,), form="off" if field.default is True else "on")
    csv = field.rule.kind in ("list", "betas")
    metavar = "A,B" if csv else {"int": "N", "float": "X", "str": "TEXT"}.get(field.rule.kind)
    return Flag((name,), (SUBMIT,), form="csv" if csv else "value", metavar=metavar)


def submit_aliases() -> dict[str, str]:
    """The path-named spelling of every declared submit flag whose name differs (`--calibration-seed` for
    `--calib-seed`), by the declared name: docs/ci.md's rule, "every field has a flag named after its path",
    holds for every field, not only for those without a shorter flag. Fields with two flags (one per beta)
    keep theirs; no alias may take a name another flag has."""
    declared = {name for _, flag in command_flags(SUBMIT) for name in flag.names}
    aliases = {}
    for f in FIELDS:
        flags = f.rule.flags_of(SUBMIT)
        if len(flags) != 1 or flags[0].positional:
            continue
        alias = path_flag_name(f)
        if alias not in declared and (flags[0].form != "off") == (not alias.startswith("--no-")):
            aliases[flags[0].names[0]] = alias
    return aliases


def command_flags(command: str) -> list[tuple[SpecField | SpecGroup, Flag]]:
    """Every (field or block, flag) of a command, in declaration order (a block's flags first)."""
    out: list[tuple[SpecField | SpecGroup, Flag]] = [
        (g, flag) for g in GROUPS for flag in g.flags if command in flag.commands]
    for f in FIELDS:
        flags = f.rule.flags_of(command)
        if not flags and command == SUBMIT:
            flags = [generated_submit_flag(f)]
        out += [(f, flag) for flag in flags]
    return out


def _shown(value: Any) -> str:
    if isinstance(value, tuple | list):
        return ",".join(str(v) for v in value)
    return json.dumps(value) if isinstance(value, bool) or value is None else str(value)


class FlagValueError(argparse.ArgumentTypeError, ValueError):
    """A flag's value that is not of its field's kind: the commands print it and exit with status 2."""


def _csv(field: SpecField, flag: Flag, text: str) -> list[Any]:
    """A comma-separated flag's value: a list of the items' kind (betas: two floats). Parsed when the
    spec is read back, not by argparse, so that the command reports it like its other user errors."""
    item_kind = "float" if field.rule.kind == "betas" else field.rule.item.kind if field.rule.item else "str"
    convert = {"int": int, "float": float}.get(item_kind, str)
    try:
        items = [convert(x.strip()) for x in text.split(",") if x.strip()]
    except ValueError:
        items = []
    if not items:
        kind = {"int": "integers", "float": "numbers"}.get(item_kind, "names")
        raise FlagValueError(f"{flag.names[0]} takes comma-separated {kind}, got {text!r}")
    return items


def add_spec_flags(parser: argparse.ArgumentParser | Any, command: str, *, groups: dict[str, Any] | None = None
                   ) -> None:
    """Add the command's flags of the job spec to `parser` (a field's flag goes to `groups[its block]`
    where given: an argument group). A flag several fields share (`--text-field` of distill's training and
    evaluation text) is added once."""
    added: set[str] = set()
    aliases = submit_aliases() if command == SUBMIT else {}
    for item, flag in command_flags(command):
        if flag.dest in added:
            continue
        added.add(flag.dest)
        target = (groups or {}).get(item.path if isinstance(item, SpecGroup) else item.group, parser)
        if isinstance(item, SpecGroup):
            target.add_argument(*flag.names, action="store_true", help=_escape(flag.help or item.doc))
            continue
        rule = item.rule
        local = command != SUBMIT
        required = local and item.required and flag.default is NO_DEFAULT  # a command's own default: optional
        default = command_default(item, flag) if local else None
        if rule.kind == "betas" and flag.form == "value":  # one flag per beta
            default = (default or (None, None))[rule.flags_of(command).index(flag)] if local else None
        help_text = flag.help or rule.doc
        if rule.kind in ("int", "float") and rule.bounds_text():
            help_text += f"; {rule.bounds_text()}"
        if not local:
            help_text = f"{item.path}: {help_text}"
        shown = default if local else item.default
        has_default = not (item.required and flag.default is NO_DEFAULT) and shown is not None
        if has_default and flag.form not in ("on", "off"):  # a switch says what it does, not its default
            help_text += f" ({'' if local else 'server '}default: {_shown(shown)})"
        kwargs: dict[str, Any] = {"help": _escape(help_text)}
        if flag.metavar:
            kwargs["metavar"] = flag.metavar
        if flag.form in ("on", "off"):
            names = (*flag.names, aliases[flag.names[0]]) if flag.names[0] in aliases else flag.names
            target.add_argument(*names, action="store_true", **kwargs)
            continue
        if flag.form == "csv":
            default = _shown(default) if default is not None else None
        elif rule.kind == "int":
            kwargs["type"] = int
        elif rule.kind in ("float", "betas"):
            kwargs["type"] = float
        elif rule.kind == "choice":
            kwargs["choices"] = rule.choices
        if flag.positional:
            target.add_argument(flag.names[0], **kwargs)
            continue
        names = (*flag.names, aliases[flag.names[0]]) if flag.names[0] in aliases else flag.names
        target.add_argument(*names, default=default, required=required, **kwargs)


def _escape(text: str) -> str:
    return text.replace("%", "%%")  # argparse formats help with %


def spec_values(args: argparse.Namespace, command: str) -> dict[str, Any]:
    """What the command's spec flags say, by dotted path (`calibration.seq_len`, or `export` for a block's
    `off` flag). A local command gives every field it has a flag for (the default where not given);
    `submit` only what was given on its command line."""
    out: dict[str, Any] = {}
    for item, flag in command_flags(command):
        raw = getattr(args, flag.dest)
        if flag.form in ("on", "off"):
            value: Any = (flag.form == "on") if raw else None if command == SUBMIT else (
                None if isinstance(item, SpecGroup) else command_default(item, flag))
        else:
            value = _csv(item, flag, raw) if flag.form == "csv" and isinstance(item, SpecField) and raw is not None \
                else raw
        if value is None and (command == SUBMIT or isinstance(item, SpecGroup)):
            continue
        if isinstance(item, SpecField) and item.rule.kind == "betas" and flag.form == "value":
            pair = list(out.get(item.path, [None, None]))
            pair[item.rule.flags_of(command).index(flag)] = value
            out[item.path] = pair
            continue
        out[item.path] = value
    return out


def set_path(spec: dict[str, Any], path: str, value: Any) -> None:
    """Set a dotted path of a job spec's body (`calibration.seq_len`), making the blocks on the way."""
    node = spec
    *parents, leaf = path.split(".")
    for part in parents:
        child = node.get(part)
        if not isinstance(child, dict):
            child = node[part] = {}
        node = child
    node[leaf] = value


def with_flags(spec: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """`spec` with what the flags say (`spec_values`) on top: each flag sets its field's path; a block a
    flag or the spec sets to false (`--no-export`, `export: false`) stays false, its fields left out."""
    off = {path for path, value in given.items() if path in GROUP_BY_PATH and value is False}
    for path, value in given.items():
        block = path.split(".")[0]
        if path not in off and block not in off and spec.get(block) is not False:
            set_path(spec, path, value)
    for path in off:
        spec[path] = False
    return spec


def with_data_sources(spec: dict[str, Any]) -> dict[str, Any]:
    """`spec` with the sources the spec's rules default to filled into a `distill.train` or `distill.eval`
    block that flags made without one (`--distill-train-seq-len 128` alone): training reads the calibration's
    text, evaluation the training's (DistillJobSpec.data_specs, the dashboard's form), with its text field.
    The server requires a source in a block that is given; left out, the block would be refused for it."""
    distill, calibration = spec.get("distill"), spec.get("calibration")
    if not isinstance(distill, dict) or not isinstance(calibration, dict) or "source" not in calibration:
        return spec
    inherited = {"source": calibration["source"], **({"text_field": calibration["text_field"]}
                                                     if "text_field" in calibration else {})}
    for part in ("train", "eval"):
        block = distill.get(part)
        if isinstance(block, dict) and "source" not in block:
            distill[part] = {**inherited, **block}
        if isinstance(distill.get(part), dict):  # evaluation's default is the training's text
            inherited = {k: distill[part][k] for k in ("source", "text_field") if k in distill[part]}
    return spec


def spec_body(args: argparse.Namespace, command: str) -> dict[str, Any]:
    """What a local command's spec flags say, as a job spec's body (what `client submit` would send)."""
    return with_flags({}, spec_values(args, command))

"""What one declared field accepts and how it is spelled on a command line: the rule every declared
parameter carries (the distillation recipe's fields, every field of a job spec).

A `FieldRule` holds the kind (int, float, bool, one of `choices`, betas, str, list), the bounds, the
one-line doc and, for a field that a command line sets, its `Flag`s: the request schema, the command
lines' flags and the dashboard's form are generated from the rules, never restated. Dependency-free:
the API process, `--help` and the client read it without numpy or torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

Kind = Literal["int", "float", "bool", "choice", "betas", "str", "list"]
# How a flag sets its field: `value` takes a value of the field's kind, `csv` a comma-separated list,
# `on` (a bare switch) sets true, `off` (a bare switch, `--no-…`, `--train-embeddings`) sets false.
FlagForm = Literal["value", "csv", "on", "off"]
# The commands whose flags are generated from declared fields: the local runs (`dtp-layout optimise`,
# `distill`, and `export`/`eval` for the model and layout fields) and `dtp-layout client submit`.
Command = Literal["optimise", "distill", "export", "eval", "submit"]
COMMANDS: tuple[Command, ...] = ("optimise", "distill", "export", "eval", "submit")

NO_DEFAULT: Any = object()  # a Flag's `default`: the command uses the field's own default


@dataclass(frozen=True)
class Flag:
    """How a field appears on some commands' command lines.

    `names` are the option strings (`--devices`, `-L`), or one bare name for a positional argument.
    `default` is the command's own default only where a command deliberately differs from the spec's
    (a local distillation evaluates on WikiText-2 by default; a service job on its training text): it is
    declared here, next to the field, so that the difference is written once and tested.
    """

    names: tuple[str, ...]
    commands: tuple[Command, ...]
    form: FlagForm = "value"
    metavar: str | None = None
    default: Any = NO_DEFAULT
    help: str | None = None  # the command line's own words where the field's doc does not fit

    @property
    def dest(self) -> str:
        """The argparse destination: the first long option (or the positional name), `-` as `_`."""
        long = next((n for n in self.names if n.startswith("--")), self.names[0])
        return long.lstrip("-").replace("-", "_")

    @property
    def positional(self) -> bool:
        return not self.names[0].startswith("-")


@dataclass(frozen=True)
class FieldRule:
    """What one field accepts: integers and floats within bounds, booleans, one of `choices`, betas, text
    (`min_length`…`max_length` characters matching `pattern`) or a list (`min_length`…`max_length` items,
    each under `item`'s rule); `nullable` where null is accepted (and means the default).

    Floats must be finite; `gt`/`ge`/`le` bound the value (and, for betas, each of the two).
    """

    kind: Kind
    doc: str
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    choices: tuple[str, ...] = ()
    min_length: int | None = None
    max_length: int | None = None
    pattern: str | None = None
    item: FieldRule | None = None
    nullable: bool = False
    examples: tuple[Any, ...] = ()
    flags: tuple[Flag, ...] = ()

    def bounds_text(self) -> str:
        lower = f"> {_num(self.gt)}" if self.gt is not None else f"≥ {_num(self.ge)}" if self.ge is not None else ""
        upper = f"< {_num(self.lt)}" if self.lt is not None else f"≤ {_num(self.le)}" if self.le is not None else ""
        return " and ".join(part for part in (lower, upper) if part)

    def within(self, value: float) -> bool:
        return ((self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
                and (self.le is None or value <= self.le) and (self.lt is None or value < self.lt))

    def flags_of(self, command: str) -> list[Flag]:
        return [f for f in self.flags if command in f.commands]


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"

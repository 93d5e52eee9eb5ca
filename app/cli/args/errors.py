"""Command-line mistakes argparse alone reports badly: an unknown flag. argparse hands a subcommand's unknown
flags up to the top-level parser, which prints the top-level usage and "unrecognized arguments"; here the
subcommand that got them reports them, with its own usage, naming the closest flag it has (difflib).
Dependency-free.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Sequence
from typing import NoReturn


class CliParser(argparse.ArgumentParser):
    """An ArgumentParser (its subcommands' parsers are of its class too) whose errors name the flags of the
    command line it does not know, with their closest known spelling: a mistyped required flag
    (`--devcies 3`) is otherwise reported as the required one missing."""

    command_line: Sequence[str] = ()  # set by parse_command_line: what the parser is parsing

    def error(self, message: str) -> NoReturn:
        unknown = [token for token in self.command_line if token.startswith("--") and not self.knows(token)]
        if unknown and "unrecognized arguments" not in message:
            message += f"; not a flag of {self.prog}: {spelled(self, unknown)}"
        super().error(message)

    def knows(self, token: str) -> bool:
        flag = token.split("=", 1)[0]
        if flag == "--" or any(isinstance(a, argparse._SubParsersAction) for a in self._actions):
            return True  # a parser with subcommands leaves the flags to them
        # argparse accepts a unique prefix of a flag (`--calib-seq` for `--calib-seq-len`)
        return any(option.startswith(flag) for action in self._actions for option in action.option_strings)


def parse_command_line(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """`parser.parse_args(argv)`, except that unknown arguments are refused by the innermost subcommand
    parser chosen (exit status 2), each unknown flag with its closest known spelling."""
    CliParser.command_line = list(sys.argv[1:] if argv is None else argv)
    try:
        args, unknown = parser.parse_known_args(argv)
        if unknown:
            chosen = chosen_parser(parser, args)
            chosen.error(f"unrecognized arguments: {spelled(chosen, unknown)}")
    finally:
        CliParser.command_line = ()  # a later parse_args of another command line must not see this one's
    return args


def chosen_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The innermost subcommand parser `args` went through (`dtp-layout client submit`), else `parser`."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            name = getattr(args, action.dest, None)
            if name in action.choices:
                return chosen_parser(action.choices[name], args)
    return parser


def closest_flag(parser: argparse.ArgumentParser, given: str) -> str | None:
    """The known option string most like `given` (its part before any `=`), or None when none is close."""
    flag = given.split("=", 1)[0]
    known = [option for action in parser._actions for option in action.option_strings if option.startswith("--")]
    matches = difflib.get_close_matches(flag, known, n=1, cutoff=0.75)  # close enough to be a typo, not any flag
    return matches[0] if matches else None


def spelled(parser: argparse.ArgumentParser, unknown: Sequence[str]) -> str:
    """`--calib-sed (did you mean --calib-seed?) 7`: each unknown flag with the closest one the parser has."""
    words = []
    for given in unknown:
        match = closest_flag(parser, given) if given.startswith("-") else None
        words.append(f"{given} (did you mean {match}?)" if match else given)
    return " ".join(words)

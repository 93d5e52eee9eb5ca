"""The `dtp-layout` command line.

Heavy modules (torch, transformers, numpy and the models.* that use them) are imported inside the
commands, so that `dtp-layout --help` is instant, the API process never imports torch through this
module, and a base install (no `worker` extra: app/cli/extras.py) runs every torch-free command; at the
top only the dependency-free names (score, dtype and layout names, the layout format).

This module builds the parser and runs a command; the commands live beside it: `export`, `eval` and `demo`
(app/cli/commands/eval_export.py), `optimise` (app/cli/commands/optimise.py), `layout` and `score`
(app/cli/commands/affinity.py), and the groups of `_EXTENSIONS`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from app.cli.args.errors import CliParser, parse_command_line
from app.cli.args.model import add_convert_cache_flag, add_layout_args, add_model_args, add_stream_flag
from app.cli.args.prechecks import precheck
from app.cli.args.schedule import add_objective_schedule_flag, schedule_flags
from app.cli.commands.affinity import cmd_layout, cmd_score
from app.cli.commands.eval_export import cmd_demo, cmd_eval, cmd_export
from app.cli.commands.optimise import cmd_optimise
from app.cli.errors import CliError, user_errors
from app.cli.extras import missing_module_message, needs_worker_extra, refusal
from models.affinity.names import SCORES
from models.base.layout_format import LAYOUT_FORMAT

__all__ = ["CliError", "build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = CliParser(prog="dtp-layout",
                                     description="Affinity-aware layouts for Delayed Tensor Parallelism")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("export", help="write the permuted HF checkpoint and per-rank DTP shards")
    add_model_args(p, "export")
    add_stream_flag(p)
    add_layout_args(p)
    p.add_argument("--out", required=True, help="output directory (gets checkpoint/ and shards/)")
    p.add_argument("--overwrite", action="store_true", help="replace existing outputs")
    p.set_defaults(func=cmd_export)
    schedule_flags(p)
    needs_worker_extra(p)

    p = sub.add_parser("eval", help="dense and DTP perplexity and KL(dense ‖ DTP) on a data spec")
    add_model_args(p, "eval")
    add_stream_flag(p)
    add_layout_args(p)
    p.add_argument("--data", required=True,
                   help="text file, directory of .txt, .jsonl, .npy of token ids, corpus:NAME, "
                        "hf:OWNER/NAME[:CFG[:SPLIT]]")
    p.add_argument("--blocks", type=int, default=16, help="number of blocks (default: 16)")
    p.add_argument("--seq-len", type=int, default=1024, help="tokens per block (default: 1024)")
    p.add_argument("--text-field", default="text", help="field of .jsonl / hf rows holding the text")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--last-scale", default="sqrt", choices=["sqrt", "one"],
                   help="own-scale of the last δ modules (default: sqrt, i.e. √L)")
    p.add_argument("--allow-overlap", action="store_true",
                   help="with --from: evaluate the blocks as given even where they are the calibration blocks the "
                        "layout was optimised on (by default, on the same text, evaluation starts after them)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_eval)
    schedule_flags(p)  # --schedule is the job spec's (the schedule simulated; default: dtp:δ of --delta)
    needs_worker_extra(p)

    p = sub.add_parser("optimise", help="affinity pass + layout optimiser (+ export of the optimised layout)")
    add_model_args(p, "optimise")  # and the calibration, the layouts scored, the export: the job spec's flags
    add_stream_flag(p)
    p.add_argument("--out", required=True,
                   help="output directory; rerunning with the same parameters and --out resumes: the stages an "
                        "earlier run finished (recorded in DIR/run.json) are skipped")
    p.add_argument("--overwrite", action="store_true",
                   help="start again: redo every stage and replace what an earlier run left in --out (its "
                        "checkpoint/shards too), whatever its parameters were")
    add_objective_schedule_flag(p, edges=True)
    p.set_defaults(func=cmd_optimise)
    schedule_flags(p)
    needs_worker_extra(p)

    p = sub.add_parser("layout", help="run only the optimiser on a saved affinity.safetensors")
    p.add_argument("--affinity", required=True, help="affinity.safetensors from `dtp-layout optimise`")
    p.add_argument("--devices", "-L", type=int, required=True)
    p.add_argument("--delta", "-d", type=int, default=1)
    p.add_argument("--score", default="fo", choices=SCORES)
    p.add_argument("--minimise", action="store_true", help="minimise J (the anti-optimised layout)")
    variant = p.add_mutually_exclusive_group()
    variant.add_argument("--heads-only", action="store_true", help="move KV groups only (neurons contiguous)")
    variant.add_argument("--neurons-only", action="store_true", help="move neurons only (KV groups contiguous)")
    p.add_argument("--layers", help="comma-separated layers to optimise (the rest stay contiguous)")
    p.add_argument("--restarts", type=int, default=4,
                   help="extra starts from random head assignments (0: the paper's procedure)")
    p.add_argument("--name", default="optimised", help="layout name stored in the JSON")
    p.add_argument("--out", required=True, help=f"output {LAYOUT_FORMAT} JSON file")
    add_objective_schedule_flag(p, edges=False)
    p.set_defaults(func=cmd_layout)

    p = sub.add_parser("score", help="rescore layouts on a saved affinity.safetensors (no model needed)")
    p.add_argument("--affinity", required=True, help="affinity.safetensors from `dtp-layout optimise`")
    p.add_argument("--score", default="fo", choices=SCORES, help="up-edge units of J (default: fo)")
    p.add_argument("layouts", nargs="+", metavar="LAYOUT.json", help=f"{LAYOUT_FORMAT} layout files")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--schedule", metavar="S",
                   help="score J_σ of this schedule (default: the paper's objective, J_σ of dtp:1); a layout made "
                        "for another schedule is scored all the same, with a warning")
    p.set_defaults(func=cmd_score)

    _register_extensions(sub)

    p = sub.add_parser("demo", help="evaluate two layouts of the packaged SmolLM2-135M on the corpus")
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--device", default="auto")
    add_convert_cache_flag(p)
    p.set_defaults(func=cmd_demo)
    needs_worker_extra(p)
    return parser


# Command groups that live in their own modules; each has `register(subparsers)` and must not import
# torch at import time (the API process and `--help` stay light).
_EXTENSIONS = ("app.cli.commands.service", "app.cli.commands.keys", "app.cli.commands.distill",
               "app.cli.client.commands", "app.cli.commands.generate",
               "app.cli.commands.vllm_serve")


def _register_extensions(sub: Any) -> None:
    import importlib

    for name in _EXTENSIONS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:
                continue
            raise
        module.register(sub)


# The commands that load a model: their arguments are checked first (app/cli/args/prechecks.py).
PRECHECKED = ("export", "eval", "optimise", "distill", "demo")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_command_line(build_parser(), argv)  # an unknown flag: the subcommand names the closest
    if message := refusal(args):  # a model command on a base install: name the extra before any work
        print(f"dtp-layout {args.command}: error: {message}", file=sys.stderr)
        return 2
    try:
        if args.command in PRECHECKED:  # before the model loads: what can be refused without it
            precheck(args, args.command)
        code: int = args.func(args)
    except ModuleNotFoundError as exc:
        if message := missing_module_message(exc):
            print(f"dtp-layout {args.command}: error: {message}", file=sys.stderr)
            return 2
        raise
    except Exception as exc:
        if isinstance(exc, user_errors()):
            print(f"dtp-layout {args.command}: error: {exc}", file=sys.stderr)
            return 2
        raise
    return code


if __name__ == "__main__":
    sys.exit(main())


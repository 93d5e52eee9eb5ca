"""`dtp-layout generate`: run the rank shards with the multi-process DTP runtime (`models.runtime`).

Registered by `app.cli.main` (see `_EXTENSIONS`). Torch-free at import: the arguments come from
`models.runtime.cli`, which imports torch only when the command runs.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from app.cli.extras import needs_worker_extra
from models.runtime.cli import add_arguments


def cmd_generate(args: argparse.Namespace) -> int:
    """Shard and request errors exit 2 (through app.cli.main's user errors: ShardError is a ValueError); a failed
    or killed rank exits 1 with the message naming it; ctrl-C stops every rank and exits 130."""
    from models.runtime.cli import run
    from models.runtime.errors import RankFailure

    try:
        return run(args)
    except RankFailure as exc:
        print(f"dtp-layout generate: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("dtp-layout generate: interrupted; every rank was stopped", file=sys.stderr)
        return 130


def register(sub: Any) -> None:
    p = sub.add_parser(
        "generate", help="run rank shards on L processes under their communication schedule (--schedule; "
                         "--schedule-override tp for the tensor-parallel timing baseline)",
        description="Generate text with the per-rank shards that export/optimise/a job wrote: one process per rank "
                    "(gloo on CPU, NCCL with one GPU per rank), prefill and cached decoding; prints the text and "
                    "per-rank ms/token and time blocked in communication. Under torchrun, this process is one rank.")
    add_arguments(p)
    p.set_defaults(func=cmd_generate)
    needs_worker_extra(p)

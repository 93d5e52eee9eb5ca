"""Write a generated documentation page, or with --check say that it is stale (docs/settings.md from the
settings, docs/service.md's tables from the job spec): the tests run the check, so a page cannot drift."""

from __future__ import annotations

import sys
from pathlib import Path


def write_or_check(path: Path, text: str, *, check: bool, stale: str) -> int:
    """0 when written (or, with check, up to date); 1 with `stale` on stderr when check finds it differs."""
    if check:
        if not path.is_file() or path.read_text() != text:
            print(stale, file=sys.stderr)
            return 1
        return 0
    path.write_text(text)
    print(f"wrote {path}", file=sys.stderr)
    return 0

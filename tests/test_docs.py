"""The README is a front page and docs/ the manual: the README stays short, every relative link of the README
and docs/ reaches a file and a heading that exist, and docs/cli.md's command table lists every command with
the install it needs (what app/cli/extras.py enforces)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _prose(text: str) -> str:
    """The text outside fenced code blocks."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#+ (.+)$", _prose(page.read_text()), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_readme_is_a_front_page():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines: the manual goes to docs/"


def test_every_relative_link_reaches_a_file_and_heading():
    broken = []
    for page in PAGES:
        for target in LINK.findall(_prose(page.read_text())):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto: not checked here
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(REPO)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{page.relative_to(REPO)}: {target} (no such heading)")
    assert broken == []


def test_the_command_table_lists_every_command_and_the_install_it_needs():
    from app.cli.main import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    table = dict(re.findall(r"^\| `([a-z-]+)` \| [^|]+ \| (.+) \|$", (REPO / "docs" / "cli.md").read_text(), re.M))
    assert set(table) == set(commands)
    for name, sub in commands.items():
        needs_worker = bool(sub.get_default("needs_worker_extra"))
        assert table[name].endswith("the `worker` extra") == needs_worker or name == "serve", (name, table[name])
    assert table["serve"].startswith("the base install with `--no-worker`")


def test_every_shard_file_the_docs_name_is_one_the_export_writes():
    """A shard's file name in README.md or docs/ is the export's own (`model-rank-N-part-0.safetensors`,
    models/export/files.py): docs/ci.md's example named `model-rank-0.safetensors`, a file no job has."""
    from models.export.files import shard_file_name

    written = re.compile(re.escape(shard_file_name(0)).replace("0", r"(\d+|N|\{r\}|r)", 1) + r"$")
    named = {(page.name, m) for page in PAGES for m in re.findall(r"model-rank-[\w{}-]*?\.safetensors",
                                                                   page.read_text())}
    assert named, "no shard file named in the docs: the pattern is stale"
    assert [(page, name) for page, name in named if not written.match(name)] == []

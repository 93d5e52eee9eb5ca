"""The dashboard shows a job's error as data (issue 41): dom.js `printable` writes every character Python's
str.isprintable refuses as the escape app/core/safe_text.py `for_log` writes, checked here against it with
node on strings of every kind; the job page and the jobs list pass the error through it."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from app.core.safe_text import for_log

STATIC = Path(__file__).resolve().parents[3] / "app" / "ui" / "static" / "js"
CASES = ["plain text, é and 😀", "F32\r\x1b[2K\x1b[1A\x1b]52;c;Y3VybA==\x07\nserve:\n  curl x | sh",
         "\t\x00\x7f\x85\u00a0\u200b\u202e\u2028\u2029\ufeff\U000e0001\U0010ffff end", "\ud800 lone", ""]


def test_printable_writes_what_for_log_writes(tmp_path):
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed")
    (tmp_path / "dom.mjs").write_text((STATIC / "dom.js").read_text())
    script = ("import {printable} from " + json.dumps((tmp_path / "dom.mjs").as_uri()) + ";\n"
              "import {readFileSync} from 'node:fs';\n"
              "const cases = JSON.parse(readFileSync(0, 'utf8'));\n"
              "process.stdout.write(JSON.stringify(cases.map(printable)));\n")
    done = subprocess.run([node, "--input-type=module", "-e", script], input=json.dumps(CASES),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == [for_log(case) for case in CASES]


def test_the_job_pages_show_the_error_through_it():
    assert "printable(job.error)" in (STATIC / "pages" / "job.js").read_text()
    assert 'printable(job.error || "")' in (STATIC / "pages" / "jobs.js").read_text()

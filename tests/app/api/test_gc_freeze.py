"""The API freezes its startup heap once per process (app/api/main.py `freeze_startup_heap`): the full
garbage collections that walked it were the load test's p99 (docs/reliability.md "## Load").

Run in a fresh interpreter: this test process has frozen (or not) according to the tests before it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]

PROBE = """
import gc, json, sys
from pathlib import Path
from fastapi.testclient import TestClient
from app.api.main import create_app
from app.core.migrate import upgrade
from app.core.settings import Settings

root = Path(sys.argv[1])
settings = Settings(var_dir=root)
upgrade(settings.database_url)
def collectable(obj):  # the permanent (frozen) generation is not among gc.get_objects()'s
    return any(o is obj for o in gc.get_objects())

counts = [gc.get_freeze_count()]
first = [object()]  # made before the first app starts: frozen with the startup heap
with TestClient(create_app(settings)) as client:
    counts.append(gc.get_freeze_count())
    status = client.get("/healthz").status_code
    leftover = len(gc.get_objects())
    first_collectable = collectable(first)
second = [object()]  # made before a second app starts in the same process: not frozen again
with TestClient(create_app(settings)):
    second_collectable = collectable(second)
print(json.dumps({"counts": counts, "status": status, "leftover": leftover,
                  "first": first_collectable, "second": second_collectable}))
"""


def test_startup_heap_is_frozen_once_per_process(tmp_path):
    out = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    before, after_start = got["counts"]
    assert before == 0
    # the libraries and the app: a hundred thousand objects or so, far more than what is left collectable
    assert after_start > 20_000
    assert after_start > 2 * got["leftover"]
    assert got["first"] is False  # frozen with the startup heap
    assert got["second"] is True  # a second app in the same process freezes nothing more
    assert got["status"] == 200

"""The tests' fault injection (tests/faults.py) reaches a worker subprocess and nothing else: a process
started with `Faults.env()` gets the patched `JobRun` once it imports worker.jobs, while one that never
imports the worker (an API process) loads neither the worker nor the faults; production settings know
nothing of them."""

from __future__ import annotations

import json
import subprocess
import sys

from app.core.settings import Settings
from tests.faults import Faults

PROBE = """
import json, sys
{body}
print(json.dumps({{"faults": "tests.faults" in sys.modules, "worker": "worker.jobs" in sys.modules,
                   "torch": "torch" in sys.modules, **extra}}))
"""


def _probe(body: str, faults: Faults | None, tmp_path) -> dict:
    import os

    env = {k: v for k, v in os.environ.items() if k != "DTP_TEST_FAULTS"}
    if faults is not None:
        env.update(faults.env(env))
    out = subprocess.run([sys.executable, "-c", PROBE.format(body=body)], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_worker_process_started_with_faults_has_them(tmp_path):
    body = "from worker.jobs import JobRun\nextra = {'patched': JobRun.should_stop.__module__}"
    assert _probe(body, Faults(stage_delay_s=0.1), tmp_path)["patched"] == "tests.faults"
    assert _probe(body, None, tmp_path)["patched"] == "worker.run"  # without them: the real code


def test_an_api_process_with_the_same_environment_loads_neither_worker_nor_faults(tmp_path):
    body = ("from fastapi.testclient import TestClient\nfrom app.api.main import create_app\n"
            f"from app.core.migrate import upgrade\nfrom app.core.settings import Settings\n"
            f"s = Settings(var_dir={str(tmp_path)!r})\nupgrade(s.database_url)\n"
            "with TestClient(create_app(s)) as c:\n    extra = {'status': c.get('/v1/jobs').status_code}")
    seen = _probe(body, Faults(stage_delay_s=0.1, hang_stage="affinity"), tmp_path)
    assert seen == {"faults": False, "worker": False, "torch": False, "status": 200}


def test_production_settings_have_no_test_hooks():
    hooks = [name for name, field in Settings.model_fields.items()
             if "test" in name or "TEST" in (field.description or "")]
    assert hooks == []

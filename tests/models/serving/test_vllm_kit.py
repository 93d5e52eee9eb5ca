"""The vLLM tests' kit reports why an engine did not start: vLLM logs a failed architecture inspection as one
ERROR line with the child's traceback under it, and only its last line ends up in the exception a test sees."""

from __future__ import annotations

from pathlib import Path

from tests.models.serving.vllm_kit import log_tail

LOG = """(MainProcess pid=1) INFO 12-07 01:00:00 [core.py:1] starting
(MainProcess pid=1) ERROR 12-07 01:00:01 [registry.py:1] Error in inspecting model architecture 'DtpMistralForCausalLM'
Traceback (most recent call last):
  File "registry.py", line 1575, in _run_in_subprocess
    returned.check_returncode()
subprocess.CalledProcessError: Command '[...]' returned non-zero exit status -9.

The above exception was the direct cause of the following exception:

RuntimeError: Error raised in subprocess:
MemoryError: the child's own cause
(MainProcess pid=1) INFO 12-07 01:00:02 [core.py:2] next
  an indented line of a later, unrelated record
""" + "INFO filler\n" * 400


def test_the_tail_keeps_an_errors_traceback_and_the_logs_end(tmp_path: Path) -> None:
    log = tmp_path / "host.log"
    log.write_text(LOG)
    tail = log_tail(log, chars=200)
    head, _, end = tail.partition("\n...\n")
    assert head.splitlines()[0].endswith("Error in inspecting model architecture 'DtpMistralForCausalLM'")
    assert "returned non-zero exit status -9." in head and head.splitlines()[-1] == "MemoryError: the child's own cause"
    assert "unrelated record" not in head  # the traceback ends at the next record
    assert end == LOG.rstrip("\n")[-200:] and "INFO filler" in end

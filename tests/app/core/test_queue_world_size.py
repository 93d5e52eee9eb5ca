"""Jobs of world size W go to their own Celery queue; a worker consumes the queues of every W up to its GPUs."""

from __future__ import annotations

from app.cli.commands.service import worker_command, worker_groups
from app.core.queue import queue_for, queues_served, world_size_of
from app.core.settings import Settings


def test_a_job_of_w_ranks_reaches_only_workers_with_at_least_w_gpus():
    one, four = Settings(queue="gpu"), Settings(queue="gpu", worker_gpus=4)
    assert queue_for(one, 1) == "gpu" and queue_for(one, 2) == "gpu-w2"
    assert queues_served(one) == ["gpu"]
    assert queues_served(four) == ["gpu", "gpu-w2", "gpu-w3", "gpu-w4"]
    for w in range(1, 5):
        takers = [s for s in (one, four) if queue_for(s, w) in queues_served(s)]
        assert takers == ([one, four] if w == 1 else [four])
    cmd = worker_command(four, name="w")
    assert cmd[cmd.index("-Q") + 1] == "gpu,gpu-w2,gpu-w3,gpu-w4"


def test_world_size_of_a_stored_spec_and_gpu_groups():
    assert world_size_of({"distill": {"world_size": 2}}) == 2
    assert world_size_of({"distill": None}) == world_size_of({}) == world_size_of(None) == 1
    assert world_size_of({"distill": {"world_size": "2"}}) == 1  # not a stored spec's shape: the default queue
    assert worker_groups(["0", "1", "2", "3"], 2) == [["0", "1"], ["2", "3"]]
    assert worker_groups(["0", "1", "2"], 2) == [["0", "1"], ["2"]]

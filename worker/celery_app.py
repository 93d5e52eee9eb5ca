"""The workers' Celery application, made from the configuration in `app/core/queue.py` (which the API
uses to enqueue by task name without importing this package)."""

from __future__ import annotations

from celery.signals import after_setup_logger, after_setup_task_logger

from app.core import logs
from app.core.queue import TASK_NAME, celery_config, enqueue, make_celery
from app.core.settings import get_settings

__all__ = ["TASK_NAME", "app", "celery_config", "enqueue", "make_celery"]

# `celery -A worker.celery_app worker` (and `dtp-layout worker`) use this instance.
app = make_celery(get_settings(), include=("worker.tasks",))

# The worker's log lines carry the job context (job id, tenant, stage) in DTP_LAYOUT_LOG_FORMAT.
after_setup_logger.connect(logs.on_celery_logger, weak=False)
after_setup_task_logger.connect(logs.on_celery_logger, weak=False)

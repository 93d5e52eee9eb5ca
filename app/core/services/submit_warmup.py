"""What the API does at start so that the first `POST /v1/jobs` answers as fast as the next ones.

A submit reads the named model's metadata (a GGUF header with its vocabulary, a config.json, a hub
snapshot's config in the Hugging Face cache), imports the modules its checks use, and sends the job
to the broker. The first of each used to cost seconds on a cold server (docs/reliability.md "Submit
latency"): the metadata of the models already there is read into the cache every tenant shares
(app.core.services.sources.warm_configs, bounded in time and files), the check modules are imported, and the
broker connection is opened (in the background: a broker that does not answer must not hold up the
start). Torch-free."""

from __future__ import annotations

import contextlib
import importlib
import logging
import threading
import time
from pathlib import Path
from typing import Any

from app.core.queue import queue_for
from app.core.services.sources import warm_configs
from app.core.settings import Settings

log = logging.getLogger(__name__)
# Imported by the submit checks on first use (app.core.services.model_limits, app.core.services.sources).
CHECK_MODULES = ("models.families", "models.streaming.memory_plan", "models.io.sizes", "models.layouts.layout",
                 "models.layouts.format", "models.schedules.grammar", "huggingface_hub",
                 "huggingface_hub.file_download")


def hub_cache() -> Path | None:
    try:
        from huggingface_hub import constants
    except ImportError:
        return None
    return Path(constants.HF_HUB_CACHE)


def warm_submit(settings: Settings, queue: Any, *, budget_s: float = 5.0) -> dict[str, Any]:
    """The check modules imported and the models' metadata read (returns what it did, for the log);
    the broker connection opened in a daemon thread."""
    t0 = time.perf_counter()
    for name in CHECK_MODULES:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    files = warm_configs(settings.models_dir, hub_cache(), budget_s=budget_s)
    threading.Thread(target=_open_broker, args=(queue, queue_for(settings, 1)), name="broker-warmup",
                     daemon=True).start()
    done = {"files": files, "seconds": round(time.perf_counter() - t0, 3)}
    log.info("submit warm-up: %d model metadata files read in %.2f s", files, done["seconds"])
    return done


def _open_broker(queue: Any, name: str) -> None:
    """The broker connection, and the jobs' queue declared (what the first publish would do: a table made
    on the SQLite broker), so that the first submit's send costs what the next ones' do."""
    try:
        queue.ping()
        celery = queue.celery
        with celery.producer_or_acquire() as producer:
            producer.maybe_declare(celery.amqp.queues[name])
    except Exception as exc:  # the submit answers 503 itself when the broker is down
        log.info("submit warm-up: the broker did not answer (%s: %s)", type(exc).__name__, exc)

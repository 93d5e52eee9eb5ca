"""Celery workers for the layout service: `celery_app` (configuration), `tasks` (the task shims) and
`jobs` (running a job's stages on `models/`, resumable and idempotent)."""

"""Alembic environment: one migration history for Postgres and SQLite (batch mode on SQLite)."""

from __future__ import annotations

from logging.config import fileConfig

from alembic import context

from app.core.db import Base, make_engine

config = context.config
if config.config_file_name is not None and config.attributes.get("configure_logging", True):
    fileConfig(config.config_file_name, disable_existing_loggers=False)


def _url() -> str:
    x_args = context.get_x_argument(as_dictionary=True)
    if x_args.get("url"):
        return x_args["url"]
    if config.get_main_option("sqlalchemy.url"):
        return str(config.get_main_option("sqlalchemy.url"))
    from app.core.settings import Settings

    return Settings().database_url


def run_migrations_offline() -> None:
    url = _url()
    context.configure(url=url, target_metadata=Base.metadata, literal_binds=True,
                      render_as_batch=url.startswith("sqlite"))
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    url = _url()
    sqlite = url.startswith("sqlite")
    engine = make_engine(url)
    try:
        with engine.connect() as connection:
            if sqlite:
                # A batch operation recreates a table (copy, DROP, rename). With foreign keys enforced,
                # SQLite's DROP TABLE of a parent first deletes its rows, and ON DELETE CASCADE would empty
                # every child table (metrics, layouts, job_events…). Off for the migration (outside any
                # transaction, where the pragma takes effect), checked afterwards.
                connection.connection.driver_connection.execute("PRAGMA foreign_keys=OFF")  # type: ignore[union-attr]
            context.configure(connection=connection, target_metadata=Base.metadata, render_as_batch=sqlite)
            with context.begin_transaction():
                context.run_migrations()
            if sqlite:
                broken = connection.exec_driver_sql("PRAGMA foreign_key_check").all()
                connection.commit()
                connection.connection.driver_connection.execute("PRAGMA foreign_keys=ON")  # type: ignore[union-attr]
                if broken:
                    raise RuntimeError(f"the migration left rows whose parent is missing: {broken[:5]}")
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()

"""`alembic upgrade head` from code: the service and the tests apply the same migrations."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config

REPO_ROOT = Path(__file__).resolve().parent.parent


def migrations_dir() -> Path:
    for candidate in (REPO_ROOT / "migrations", Path.cwd() / "migrations"):
        if (candidate / "env.py").is_file():
            return candidate
    raise FileNotFoundError("migrations/ not found beside the package or in the working directory")


def alembic_config(database_url: str) -> Config:
    ini = migrations_dir().parent / "alembic.ini"
    config = Config(str(ini)) if ini.is_file() else Config()
    config.set_main_option("script_location", str(migrations_dir()))
    config.set_main_option("sqlalchemy.url", database_url.replace("%", "%%"))
    config.attributes["configure_logging"] = False
    return config


def upgrade(database_url: str, revision: str = "head") -> None:
    command.upgrade(alembic_config(database_url), revision)


def downgrade(database_url: str, revision: str = "base") -> None:
    command.downgrade(alembic_config(database_url), revision)

"""`alembic upgrade head` from code: the service and the tests apply the same migrations.

The migrations are the top-level `migrations` folder, shipped in the wheel as a package beside `app`
(pyproject.toml), so an installed `dtp-layout` (no checkout) finds them where a checkout has them and
migrates its database the same way; `alembic.ini` is only for running `alembic` by hand in a checkout.
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config

REPO_ROOT = Path(__file__).resolve().parents[2]  # a checkout, or site-packages for an installed wheel
MIGRATIONS_DIR = REPO_ROOT / "migrations"


def alembic_config(database_url: str) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.set_main_option("path_separator", "os")
    config.set_main_option("sqlalchemy.url", database_url.replace("%", "%%"))
    config.attributes["configure_logging"] = False
    return config


def upgrade(database_url: str, revision: str = "head") -> None:
    command.upgrade(alembic_config(database_url), revision)


def downgrade(database_url: str, revision: str = "base") -> None:
    command.downgrade(alembic_config(database_url), revision)

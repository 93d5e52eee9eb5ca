"""Packaging, statically: pyproject.toml applies without deprecation warnings (the licence is an SPDX expression),
the `worker` extra is the one the CLI checks, and the images and the Makefile install the extras they should.
tests/test_install.py installs the base package for real."""

from __future__ import annotations

import re
import tomllib
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_pyproject_applies_without_warnings():
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.simplefilter("ignore", ResourceWarning)  # another test's file closed by the collector here
        dist = apply_configuration(Distribution(), REPO / "pyproject.toml")
    assert [str(w.message) for w in caught] == []
    assert dist.metadata.license_expression == "Apache-2.0"
    assert dist.get_name() == "dtp-layout"


def _requirement_names(requirements: list[str]) -> set[str]:
    return {re.match(r"[A-Za-z0-9_.-]+", r).group(0).lower().replace("_", "-") for r in requirements}


def test_the_worker_extra_is_what_the_cli_checks_and_stays_out_of_the_base():
    from app.cli.extras import WORKER_PACKAGES

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    worker = _requirement_names(project["optional-dependencies"]["worker"])
    assert worker == set(WORKER_PACKAGES)  # these distributions import under their own names
    assert not worker & _requirement_names(project["dependencies"])


def test_images_and_make_install_the_extras():
    def installs(dockerfile: str) -> list[str]:
        text = (REPO / "docker" / dockerfile).read_text()
        return re.findall(r"^RUN pip install (?:--[\w-]+ \S+ )*(\S+)", text, re.M)

    assert installs("Dockerfile.api") == ["."]  # the base install: no torch in the API image
    assert installs("Dockerfile.worker") == ['"${TORCH_SPEC}"', '".[worker,hf]"']
    make = (REPO / "Makefile").read_text()
    assert "-e '.[worker,dev,hf]'" in make
    assert re.search(r"^\t\$\(BIN\)/mypy models app worker tools$", make, re.M)


def test_docker_copies_name_existing_paths():
    for dockerfile in (REPO / "docker").glob("Dockerfile.*"):
        for line in dockerfile.read_text().splitlines():
            if line.startswith("COPY ") and "--from" not in line:
                for source in line.split()[1:-1]:
                    assert (REPO / source).exists(), f"{dockerfile.name}: {line}"

"""Packaging: pyproject.toml applies without deprecation warnings (the licence is an SPDX expression)."""

from __future__ import annotations

import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_pyproject_applies_without_warnings():
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist = apply_configuration(Distribution(), REPO / "pyproject.toml")
    assert [str(w.message) for w in caught] == []
    assert dist.metadata.license_expression == "Apache-2.0"
    assert dist.get_name() == "dtp-layout"

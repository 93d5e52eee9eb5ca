"""The layout file format's identity and the error every layout module raises.

Dependency-free (no numpy), so that the CLI's help and the API's request checks name the format, and
the name grammar raises `LayoutError`, without loading the math.
"""

from __future__ import annotations

LAYOUT_FORMAT = "dtp-layout/1"


class LayoutError(ValueError):
    """A layout (or the request for one) is malformed, unbalanced or does not fit the model."""

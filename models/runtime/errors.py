"""What can go wrong when running rank shards, as exceptions a caller can tell apart.

Torch-free, so that the CLI can name them without importing torch.
"""

from __future__ import annotations


class DTPRuntimeError(RuntimeError):
    """Base class of the runtime's errors."""


class ShardError(DTPRuntimeError, ValueError):
    """The shards cannot be run as given: a manifest, config, file, checksum, tensor shape or world-size
    mismatch. Raised on every rank before any compute; the model is never partially loaded."""


class RankFailure(DTPRuntimeError):
    """A rank died, hung, timed out in a collective or raised: the group is broken and has been stopped."""


class RuntimeStopped(DTPRuntimeError):
    """The runtime was stopped (or never started) and cannot take commands."""

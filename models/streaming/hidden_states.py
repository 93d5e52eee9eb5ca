"""The calibration blocks' residual streams between layers of a streamed pass: one [T, D] tensor per
micro-batch, kept in memory, or spilled to a scratch directory when they would not fit the memory
limit (each micro-batch a raw file of its tensor's bytes, read back whole when its turn comes, so that
one micro-batch at a time is in memory). Scratch data, deleted when the pass ends; not a weight format.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch


class HiddenStates:
    """Per micro-batch residual streams; `spill_dir` set: on disk under it, else in memory."""

    def __init__(self, spill_dir: Path | None = None) -> None:
        self._memory: dict[int, torch.Tensor] = {}
        self._shapes: dict[int, tuple[torch.Size, torch.dtype]] = {}
        self._dir = Path(tempfile.mkdtemp(prefix="dtp-hidden-", dir=spill_dir)) if spill_dir is not None else None

    @property
    def spilled(self) -> bool:
        return self._dir is not None

    def put(self, batch: int, x: torch.Tensor) -> None:
        if self._dir is None:
            self._memory[batch] = x
            return
        x = x.detach().cpu().contiguous()
        self._shapes[batch] = (x.shape, x.dtype)
        path = self._dir / f"{batch}.bin"
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.write(x.reshape(-1).view(torch.uint8).numpy().tobytes())
        os.replace(tmp, path)

    def get(self, batch: int, device: torch.device) -> torch.Tensor:
        if self._dir is None:
            return self._memory[batch]
        shape, dtype = self._shapes[batch]
        flat = torch.from_file(str(self._dir / f"{batch}.bin"), shared=False, size=shape.numel(), dtype=dtype)
        return flat.view(shape).to(device)

    def close(self) -> None:
        self._memory.clear()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)

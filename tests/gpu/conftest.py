"""The `gpu` tests: the CUDA path against the CPU path, and the worker on a GPU.

They need CUDA and are skipped without it (listed with the reason at the end of the run); `make
gpu-check` runs them on a GPU machine. `DTP_LAYOUT_GPU_TEST_DEVICE=cpu` runs the same tests with the CPU
standing in for the accelerator (fp32 comparisons become trivial, the bf16-autocast ones do not): that
is how `bench/gpu_check.py --tiny` proves the test code itself on a machine without a GPU.
"""

from __future__ import annotations

import os

import pytest
import torch

GPU_TEST_DEVICE = os.environ.get("DTP_LAYOUT_GPU_TEST_DEVICE", "cuda")


def no_cuda_reason() -> str:
    return (f"CUDA is not available (torch {torch.__version__}, CUDA build {torch.version.cuda or 'none'}); "
            "the gpu tests run on a GPU machine with `make gpu-check`")


@pytest.fixture(scope="session")
def accelerator() -> torch.device:
    """The device under test: a CUDA device (TF32 off, so that fp32 means fp32), or the CPU stand-in."""
    device = torch.device(GPU_TEST_DEVICE)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            pytest.skip(no_cuda_reason())
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    return device

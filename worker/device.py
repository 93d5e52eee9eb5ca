"""The worker's torch device: which one a job runs on, what the job reports about it, and what an
out-of-memory failure tells the user.

- `prepare_device(setting, memory_fraction)` resolves `DTP_LAYOUT_DEVICE` (`auto` picks the GPU when
  CUDA is available; `dtp-layout worker --gpus 0,1` gives each worker process one visible device, so
  `cuda` is that one), caps this process's share of the GPU when asked, resets the peak-memory
  counters and returns a JSON-able description recorded in the job (`device` in the job view).
- `out_of_memory_message(exc, stage=...)` turns a torch out-of-memory error into one sentence saying how
  much memory the stage needed, how much there was, and what to change; None for any other error.

Torch is imported inside the functions (the API process imports nothing from worker/).
"""

from __future__ import annotations

import re
from typing import Any

GIB = 1 << 30
MIB = 1 << 20
_UNITS = {"B": 1, "bytes": 1, "KiB": 1 << 10, "MiB": MIB, "GiB": GIB, "TiB": 1 << 40}
_SIZE = r"([0-9.]+) ?(bytes|B|KiB|MiB|GiB|TiB)"
# Fields of PyTorch's CUDA allocator message ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a
# total capacity of 79.19 GiB of which 1.06 GiB is free. ... Of the allocated memory 75.2 GiB is allocated
# by PyTorch, with 70.00 GiB allowed, and ..."); older releases word a few of them differently.
_CUDA_FIELDS = {
    "tried": rf"[Tt]ried to allocate {_SIZE}",
    "total": rf"(?:total capacity of {_SIZE}|{_SIZE} total capacity)",
    "free": rf"(?:of which {_SIZE} is free|{_SIZE} free)",
    "allocated": rf"(?:{_SIZE} is allocated by PyTorch|{_SIZE} already allocated)",
    "allowed": rf"(?:with {_SIZE} allowed|{_SIZE} allowed)",
}
_CPU_TRIED = re.compile(r"(?:you )?tried to allocate (\d+) bytes")
# What to change, by the stage that ran out (anything else: all of it).
MORE_MEMORY = "or run it on a worker with more memory"
ADVICE = {
    "loading": f"the weights alone do not fit: use model.dtype bfloat16 {MORE_MEMORY}",
    "affinity": f"lower the job's batch_size (calibration sequences per micro-batch), use model.dtype bfloat16 "
                f"{MORE_MEMORY}",
    "exporting": f"the export holds a permuted copy of the weights: use model.dtype bfloat16 {MORE_MEMORY}",
    "distilling": f"lower distill.recipe.micro_batch_size or set distill.recipe.gradient_checkpointing "
                  f"{MORE_MEMORY}",
}
ADVICE_ANY = (f"lower the job's batch_size or distill.recipe.micro_batch_size, use model.dtype bfloat16 "
              f"{MORE_MEMORY}")


def _bytes(number: str, unit: str) -> int:
    return int(float(number) * _UNITS[unit])


def human(n: float | None) -> str:
    if n is None:
        return "?"
    if n >= GIB:
        return f"{n / GIB:.2f} GiB"
    return f"{n / MIB:.2f} MiB"


def parse_cuda_oom(message: str) -> dict[str, int]:
    """The sizes named in a CUDA out-of-memory message, in bytes (only those present)."""
    found: dict[str, int] = {}
    for key, pattern in _CUDA_FIELDS.items():
        match = re.search(pattern, message)
        if match:
            groups = [g for g in match.groups() if g is not None]
            found[key] = _bytes(groups[0], groups[1])
    return found


def resolve(setting: str) -> Any:
    """The torch.device a worker with DTP_LAYOUT_DEVICE=`setting` uses (`cuda` means the current device)."""
    import torch

    from models.io.loading import resolve_device

    device = resolve_device(setting)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def describe(device: Any) -> dict[str, Any]:
    """What the job records about its device: `{"device": "cuda:0", "name": ..., "memory_total_gib": ...}`."""
    import torch

    info: dict[str, Any] = {"device": str(device), "torch": torch.__version__}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(name=props.name, memory_total_gib=round(props.total_memory / GIB, 2),
                    capability=f"{props.major}.{props.minor}", cuda=torch.version.cuda,
                    visible_devices=torch.cuda.device_count())
    else:
        info.update(name="cpu", threads=torch.get_num_threads())
    return info


def prepare_device(setting: str, memory_fraction: float | None = None) -> dict[str, Any]:
    """Resolve the worker's device for a job, apply the memory cap, reset the peak counters; its description."""
    import torch

    device = resolve(setting)
    info = describe(device)
    if device.type == "cuda":
        if memory_fraction is not None:
            torch.cuda.set_per_process_memory_fraction(memory_fraction, device)
            info["memory_fraction"] = memory_fraction
        torch.cuda.reset_peak_memory_stats(device)
    return info


def _is_oom(exc: BaseException) -> bool:
    import torch

    if isinstance(exc, torch.OutOfMemoryError | MemoryError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(
        words in text for words in ("out of memory", "can't allocate memory", "not enough memory"))


def out_of_memory_message(exc: BaseException, *, stage: str | None) -> str | None:
    """One sentence for an out-of-memory failure (None when `exc` is something else).

    Called while the failing stage's tensors are still referenced by the traceback, so the allocator's
    counters still show what the stage held when the allocation failed.
    """
    if not _is_oom(exc):
        return None
    import torch

    where = f"in stage {stage}" if stage else "before the first stage"
    text = str(exc)
    if "CUDA" in text or isinstance(exc, torch.OutOfMemoryError):
        sizes = parse_cuda_oom(text)
        held = peak = None
        if torch.cuda.is_available():
            held, peak = torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()
        held = held if held else sizes.get("allocated")
        tried = sizes.get("tried")
        gpu = _gpu_name()
        parts = [f"out of GPU memory {where}{gpu}:"]
        if tried is not None:
            needed = (held or 0) + tried
            parts.append(f"needed at least {human(needed)} ({human(held or 0)} held by the job + {human(tried)} "
                         f"it tried to allocate)")
        else:
            parts.append("an allocation failed")
        if "allowed" in sizes:
            parts.append(f"but this worker may use only {human(sizes['allowed'])} (its memory cap, "
                         "DTP_LAYOUT_CUDA_MEMORY_FRACTION)")
        elif "total" in sizes:
            free = sizes.get("free")
            parts.append(f"but the GPU has {human(sizes['total'])}"
                         + (f", {human(free)} of it free" if free is not None else ""))
        if peak:
            parts.append(f"(peak {human(peak)} allocated by this job)")
        return " ".join(parts) + f"; {ADVICE.get(stage or '', ADVICE_ANY)}"
    match = _CPU_TRIED.search(text)
    what = f"{human(int(match.group(1)))} in one allocation" if match else "more than the machine had"
    return f"out of host memory {where}: the job needed {what}; {ADVICE.get(stage or '', ADVICE_ANY)}"


def _gpu_name() -> str:
    import torch

    if not torch.cuda.is_available():
        return ""
    index = torch.cuda.current_device()
    return f" on cuda:{index} ({torch.cuda.get_device_name(index)})"

"""The vLLM plugin's settings: how a schedule's exchanges run (`exchange`) and the emulated link latency
(`link_latency_us`). Torch- and vLLM-free, so `dtp-layout vllm-serve` validates them before starting vLLM.

    eager     each exchange is all-reduced as soon as its last partial is computed, with vLLM's own
              all-reduce (shared memory on CPU, custom all-reduce or NCCL on GPU); the others' share
              (total − own) waits δ modules and enters the stream where the schedule says: the same numbers
              as overlap. For platforms where communication cannot run beside compute (this CPU: the
              shared-memory all-reduce is itself compute, and gloo's async all-reduce costs far more).
    overlap   each delayed exchange is started as an asynchronous torch.distributed all-reduce on the TP
              group's device group and waited for only where it is due (an exchange due right away still
              goes through vLLM's all-reduce). For GPUs, where NCCL runs on its own stream.

Where each comes from, first found: the environment of every vLLM process (DTP_LAYOUT_VLLM_EXCHANGE,
DTP_LAYOUT_VLLM_LINK_LATENCY_US, which `dtp-layout vllm-serve --exchange / --link-latency-us` set), the
config's `dtp` entry (`exchange`, `link_latency_us`), the platform's default (CUDA: overlap; else eager)
and 0 µs.

`link_latency_us` emulates a slower interconnect as the project's runtime does (models/runtime/exchange.py):
a collective's result becomes usable that long after it completed; a rank that needs it sooner waits the
rest, and compute in between covers it. TP waits at once and pays it on every exchange.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["EXCHANGE_ENV", "EXCHANGE_MODES", "LATENCY_ENV", "MAX_LINK_LATENCY_US", "PluginSettings",
           "check_exchange", "check_link_latency", "default_exchange", "resolve_settings"]

EXCHANGE_MODES = ("eager", "overlap")
EXCHANGE_ENV = "DTP_LAYOUT_VLLM_EXCHANGE"
LATENCY_ENV = "DTP_LAYOUT_VLLM_LINK_LATENCY_US"
MAX_LINK_LATENCY_US = 1_000_000.0  # one second per exchange: beyond any link worth emulating


@dataclass(frozen=True)
class PluginSettings:
    exchange: str  # one of EXCHANGE_MODES
    link_latency_us: float
    source: str  # where the exchange mode came from, for the line printed at engine start

    def describe(self) -> str:
        return (f"exchange {self.exchange} ({self.source}; {EXCHANGE_ENV} or vllm-serve --exchange "
                f"{'|'.join(EXCHANGE_MODES)}), link latency {self.link_latency_us:g} µs")


def check_exchange(value: Any, where: str) -> str:
    if value not in EXCHANGE_MODES:
        raise ValueError(f"{where}: exchange mode must be one of {', '.join(EXCHANGE_MODES)}, got {value!r}")
    return str(value)


def check_link_latency(value: Any, where: str) -> float:
    try:
        latency = float(value)
    except (TypeError, ValueError):
        latency = math.nan
    if not 0.0 <= latency <= MAX_LINK_LATENCY_US:  # also refuses NaN
        raise ValueError(f"{where}: link latency must be a number of µs in [0, {MAX_LINK_LATENCY_US:g}], "
                         f"got {value!r}")
    return latency


def default_exchange(platform: str) -> str:
    """overlap where the collective runs on a stream of its own (CUDA's NCCL); eager elsewhere."""
    return "overlap" if platform == "cuda" else "eager"


def resolve_settings(entry: Mapping[str, Any] | None, environ: Mapping[str, str], platform: str) -> PluginSettings:
    """The settings from the environment, else the config's `dtp` entry, else the platform's defaults."""
    entry = entry or {}
    if environ.get(EXCHANGE_ENV):
        exchange, source = check_exchange(environ[EXCHANGE_ENV], EXCHANGE_ENV), f"from {EXCHANGE_ENV}"
    elif entry.get("exchange") is not None:
        exchange, source = check_exchange(entry["exchange"], "config 'dtp'.exchange"), "from config 'dtp'.exchange"
    else:
        exchange, source = default_exchange(platform), f"the default on {platform}"
    if environ.get(LATENCY_ENV):
        latency = check_link_latency(environ[LATENCY_ENV], LATENCY_ENV)
    else:
        latency = check_link_latency(entry.get("link_latency_us", 0.0), "config 'dtp'.link_latency_us")
    return PluginSettings(exchange, latency, source)

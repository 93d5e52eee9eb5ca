"""The exchange of partials between ranks, and the time each rank spends blocked waiting for it.

`start` launches an asynchronous all-reduce (sum) of the partials that arrive together before module
t (one module's partial, or the sum of several: `models.runtime.arrivals`) right after the last of
them is computed; `wait` is called only before module t, and returns the sum over all ranks (this
rank's own partials included: the caller subtracts them where the schedule added them already).
Under tp the wait follows the start at once: the blocking all-reduce of standard tensor
parallelism.

`link_latency_us` emulates a slower interconnect honestly: a collective's result becomes usable
that long after the collective actually completed (on gloo, the completion time is recorded by a
callback on the work's future), as if the last message had been in flight that much longer. A rank
that waits before then is blocked for the rest; compute that runs in between covers it, as it
would cover a real link's latency. Standard TP waits at once and so pays it on every collective.

Blocked time is what the waits cost this rank. On CUDA (NCCL) a wait only orders the compute
stream after the collective; to measure it, the rank synchronises the compute stream first (not
counted), then times the wait with a stream synchronise (counted). That costs the host its
run-ahead at each wait, so GPU timings from this runtime are measurements, not a tuned server.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from models.runtime.group import RankGroup


@dataclass
class InFlight:
    """A started exchange: the buffer being reduced, this rank's own partial, and when it completed."""

    arrival: int  # the module before which it is waited for
    work: Any
    total: torch.Tensor
    own: torch.Tensor
    completed: list[float]  # filled by the work's completion callback (gloo)


@dataclass
class BlockedTime:
    exchange_s: float = 0.0  # waits on the partials of modules
    head_s: float = 0.0  # the final reduction to rank 0 and the token broadcast
    exchanges: int = 0

    @property
    def total_s(self) -> float:
        return self.exchange_s + self.head_s


class Exchange:
    def __init__(self, group: RankGroup, *, link_latency_us: float = 0.0) -> None:
        if link_latency_us < 0:
            raise ValueError(f"link_latency_us must be >= 0, got {link_latency_us}")
        self.group = group
        self.latency_s = link_latency_us * 1e-6
        self.cuda = group.device.type == "cuda"
        self.blocked = BlockedTime()

    def reset(self) -> BlockedTime:
        done, self.blocked = self.blocked, BlockedTime()
        return done

    def start(self, partial: torch.Tensor, arrival: int) -> InFlight:
        """Launch the sum of `partial` over the ranks without waiting for it (due before module `arrival`)."""
        total = partial.detach().clone()
        try:
            work = dist.all_reduce(total, op=dist.ReduceOp.SUM, async_op=True)
        except Exception as exc:
            raise self.group.lost(f"starting the exchange due before module {arrival}", exc) from exc
        self.blocked.exchanges += 1
        return InFlight(arrival, work, total, partial, self._completion_time(work))

    def wait(self, flight: InFlight) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum over ranks, own partial) of a started exchange, blocking until it is usable."""
        during = f"the exchange due before module {flight.arrival}"
        self.blocked.exchange_s += self._wait(flight.work, flight.completed, during)
        return flight.total, flight.own

    def _completion_time(self, work: Any) -> list[float]:
        """A list that gets the time the collective completes (gloo runs future callbacks at completion;
        NCCL's futures follow the stream, so there the completion is taken when the wait returns)."""
        completed: list[float] = []
        if self.latency_s > 0 and not self.cuda:
            work.get_future().add_done_callback(lambda _: completed.append(time.perf_counter()))
        return completed

    def _wait(self, work: Any, completed: list[float], during: str) -> float:
        if self.cuda:
            torch.cuda.current_stream().synchronize()  # compute done: what follows is waiting
        t0 = time.perf_counter()
        try:
            work.wait()
            if self.cuda:
                torch.cuda.current_stream().synchronize()
        except Exception as exc:
            raise self.group.lost(during, exc) from exc
        if self.latency_s > 0:
            # Usable `latency` after it completed (a callback racing the wait's return counts as now).
            remaining = (completed[0] if completed else time.perf_counter()) + self.latency_s - time.perf_counter()
            if remaining > 0:
                time.sleep(remaining)
        return time.perf_counter() - t0

    def reduce_to_first(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum of `tensor` over the ranks, on rank 0 (blocking)."""
        try:
            work = dist.reduce(tensor, dst=0, op=dist.ReduceOp.SUM, async_op=True)
        except Exception as exc:
            raise self.group.lost("the final reduction", exc) from exc
        self.blocked.head_s += self._wait(work, self._completion_time(work), "the final reduction")
        return tensor

    def broadcast_from_first(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's `tensor` on every rank (blocking)."""
        try:
            work = dist.broadcast(tensor, src=0, async_op=True)
        except Exception as exc:
            raise self.group.lost("the token broadcast", exc) from exc
        self.blocked.head_s += self._wait(work, self._completion_time(work), "the token broadcast")
        return tensor

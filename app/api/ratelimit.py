"""Request rate limits: a token bucket per key (per client address for requests without a valid key).

Buckets live in the API process (several API processes each apply the limit). The table of buckets
is bounded: the least recently used bucket goes first, so a flood of addresses cannot grow memory.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict


class RateLimiter:
    def __init__(self, per_minute: int, burst: int, *, max_buckets: int = 10_000) -> None:
        self.rate = per_minute / 60.0  # tokens per second
        self.burst = float(max(1, burst))
        self.max_buckets = max_buckets
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # who → (tokens, at)
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.rate > 0

    def take(self, who: str) -> float:
        """Spend one request of `who`: 0 when allowed, else the seconds until one is available."""
        if not self.enabled:
            return 0.0
        now = time.monotonic()
        with self._lock:
            tokens, at = self._buckets.pop(who, (self.burst, now))
            tokens = min(self.burst, tokens + (now - at) * self.rate)
            wait = 0.0
            if tokens >= 1.0:
                tokens -= 1.0
            else:
                wait = (1.0 - tokens) / self.rate
            self._buckets[who] = (tokens, now)
            while len(self._buckets) > self.max_buckets:
                self._buckets.popitem(last=False)
        return wait

"""In-process rate limiting: one token bucket per key (a bearer token, or a client IP for joining).

A bucket holds up to ``burst`` requests and refills at ``rate`` per second; a request takes one. An empty
bucket answers 429 with ``Retry-After`` (whole seconds until the next request is allowed). The key table
is bounded (least recently used keys are dropped, which only refills their bucket)."""
from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from fastapi import HTTPException, Request


@dataclass(frozen=True)
class Limit:
    rate: float  # requests per second, sustained; <= 0 disables the limit
    burst: int  # requests allowed at once

    @property
    def enabled(self) -> bool:
        return self.rate > 0 and self.burst > 0


class Buckets:
    def __init__(self, limit: Limit, max_keys: int = 100_000, clock: Callable[[], float] = time.monotonic) -> None:
        self.limit, self.max_keys, self.clock = limit, max_keys, clock
        self._state: OrderedDict[str, tuple[float, float]] = OrderedDict()  # key -> (tokens, last time)
        self._lock = threading.Lock()

    def take(self, key: str, consume: bool = True) -> float:
        """Take one request from ``key``'s bucket: 0.0 if allowed, else the seconds until one is.
        ``consume=False`` only looks (the bucket keeps its request)."""
        if not self.limit.enabled:
            return 0.0
        rate, burst = self.limit.rate, float(self.limit.burst)
        with self._lock:
            now = self.clock()
            tokens, last = self._state.pop(key, (burst, now))
            tokens = min(burst, tokens + (now - last) * rate)
            wait = 0.0 if tokens >= 1 else (1 - tokens) / rate
            self._state[key] = (tokens - 1 if wait == 0.0 and consume else tokens, now)
            if len(self._state) > self.max_keys:
                self._state.popitem(last=False)
        return wait

    def check(self, key: str, what: str, consume: bool = True) -> None:
        """Raise 429 (with Retry-After) when ``key`` is over its limit; ``what`` names it in the message;
        ``consume=False``: raise when it is, without taking a request."""
        wait = self.take(key, consume)
        if wait > 0:
            retry = max(1, math.ceil(wait))
            raise HTTPException(429, f"rate limit exceeded for {what} ({self.limit.rate:g} requests/s, burst "
                                     f"{self.limit.burst}); retry after {retry} s",
                                headers={"Retry-After": str(retry)})


def client_address(request: Request) -> str:
    """The peer's address (a proxy's X-Forwarded-For counts only from FL_SERVE_TRUSTED_PROXIES: server.py)."""
    return request.client.host if request.client else "unknown"


async def limit_join(request: Request) -> None:
    """Dependency of the unauthenticated join: one bucket per client IP."""
    request.app.state.service.join_limits.check(f"ip:{client_address(request)}", "joins from this IP")

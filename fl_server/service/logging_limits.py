"""Rate-limited log lines: under attack the same warning (an invalid request, a closed transport's traceback)
must not grow the log by a line per request. One token bucket per message (logger, level and format string,
not its arguments): ``burst`` lines at once, then ``rate`` per second; the next line that passes after some were
dropped ends with ``(suppressed N similar lines)``.

``install()`` puts one shared filter on every handler configured so far (``fl-server serve`` calls it once
uvicorn has configured its loggers); settings ``FL_SERVE_LOG_RATE`` (lines/s per message, 0.1) and
``FL_SERVE_LOG_BURST`` (20; a rate or burst of 0 turns the limit off)."""
from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict

_CHECKED = "_fl_log_limit_passed"  # a record met by several handlers is decided once


class LogRateLimit(logging.Filter):
    def __init__(self, rate: float, burst: int, max_keys: int = 1000) -> None:
        super().__init__()
        self.rate, self.burst, self.max_keys = rate, burst, max_keys
        self._state: OrderedDict[tuple[str, int, str], tuple[float, float, int]] = OrderedDict()
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        decided = getattr(record, _CHECKED, None)
        if decided is not None:
            return bool(decided)
        if self.rate <= 0 or self.burst <= 0:
            return True
        key = (record.name, record.levelno, str(record.msg)[:200])
        with self._lock:
            now = time.monotonic()
            tokens, last, dropped = self._state.pop(key, (float(self.burst), now, 0))
            tokens = min(float(self.burst), tokens + (now - last) * self.rate)
            passed = tokens >= 1
            if passed and dropped:
                record.msg = f"{record.msg} (suppressed {dropped} similar lines)"
            self._state[key] = (tokens - 1, now, 0) if passed else (tokens, now, dropped + 1)
            if len(self._state) > self.max_keys:
                self._state.popitem(last=False)
        setattr(record, _CHECKED, passed)
        return passed


def install(rate: float | None = None, burst: int | None = None) -> LogRateLimit:
    """One :class:`LogRateLimit` on every handler of the root logger and of every configured logger."""
    limit = LogRateLimit(float(os.environ.get("FL_SERVE_LOG_RATE", "0.1")) if rate is None else rate,
                         int(os.environ.get("FL_SERVE_LOG_BURST", "20")) if burst is None else burst)
    loggers = [logging.getLogger(), *(lg for lg in logging.root.manager.loggerDict.values()
                                      if isinstance(lg, logging.Logger))]
    for handler in {h for lg in loggers for h in lg.handlers}:
        handler.addFilter(limit)
    return limit

"""Micro-batching of concurrent async calls into one synchronous batch call on a worker thread.

While one batch runs, the calls that arrive queue up and go together in the next one; nothing waits for a
batch to fill (no timer), so a lone call goes out at once and a burst is amortised. The batch function runs on
a dedicated thread, never on the event loop: used for the hypernetwork's batched forward (one ``[K, E]``
matmul instead of K).

The worker thread drains the queue itself: when a batch ends it hands the results to the event loop (one
``call_soon_threadsafe`` per batch) and starts the next batch at once. Under load the event loop's ready queue
is long, so a design where the loop schedules each batch (``run_in_executor`` per batch) waited one full loop
iteration between batches: 45-67 ms per hop with 200 devices on 2 cores (benchmarks/profile_burst.py,
docs/coordinator.md)."""
from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")

_Pending = tuple[T, "asyncio.Future[R]", asyncio.AbstractEventLoop]


class MicroBatcher(Generic[T, R]):
    """``await batcher.submit(key, item)`` -> ``fn(key, [items...])[i]`` for this item. Calls with different
    keys never share a batch; batches run one at a time on one thread, each key's items in arrival order, and
    keys take turns in the order they first had work waiting."""

    def __init__(self, fn: Callable[[Hashable, list[T]], Sequence[R]], max_batch: int = 64,
                 name: str = "batcher") -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        self.fn, self.max_batch = fn, max_batch
        self._queues: dict[Hashable, deque[_Pending]] = {}
        self._turns: deque[Hashable] = deque()  # keys with work waiting, oldest first
        self._wake = threading.Condition()
        self._closed = False
        self.batches = 0  # how many batch calls ran (observability, tests)
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    async def submit(self, key: Hashable, item: T) -> R:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[R] = loop.create_future()
        with self._wake:
            if self._closed:
                raise RuntimeError("the batcher is closed")
            queue = self._queues.get(key)
            if queue is None:
                queue = self._queues[key] = deque()
                self._turns.append(key)
            queue.append((item, fut, loop))
            self._wake.notify()
        return await fut

    def _next_batch(self) -> tuple[Hashable, list[_Pending]] | None:
        """The oldest waiting key's next batch (blocks until there is one); None once closed."""
        with self._wake:
            while not self._turns and not self._closed:
                self._wake.wait()
            if not self._turns:
                return None
            key = self._turns.popleft()
            queue = self._queues[key]
            batch = [queue.popleft() for _ in range(min(self.max_batch, len(queue)))]
            if queue:
                self._turns.append(key)  # the rest waits for its turn behind other keys
            else:
                del self._queues[key]
            return key, batch

    def _work(self) -> None:
        while (nxt := self._next_batch()) is not None:
            key, batch = nxt
            self.batches += 1
            try:
                results: Sequence[R] | BaseException = self.fn(key, [item for item, _, _ in batch])
                if len(results) != len(batch):
                    raise RuntimeError(f"batch function returned {len(results)} results for {len(batch)} items")
            except Exception as exc:  # surfaced to every waiting call of this batch
                results = exc
            for loop in {id(lp): lp for _, _, lp in batch}.values():
                mine = [(fut, i) for i, (_, fut, lp) in enumerate(batch) if lp is loop]
                try:
                    loop.call_soon_threadsafe(_deliver, mine, results)
                except RuntimeError:  # that event loop is closed: nobody is waiting any more
                    pass

    def close(self) -> None:
        """Stop after the batch that is running; calls still queued get a RuntimeError."""
        with self._wake:
            self._closed = True
            left = [p for q in self._queues.values() for p in q]
            self._queues.clear()
            self._turns.clear()
            self._wake.notify_all()
        for _, fut, loop in left:
            try:
                loop.call_soon_threadsafe(_deliver, [(fut, 0)], RuntimeError("the batcher is closed"))
            except RuntimeError:
                pass
        if threading.current_thread() is not self._thread:
            self._thread.join()


def _deliver(futures: list[tuple[asyncio.Future[R], int]], results: Sequence[R] | BaseException) -> None:
    """On the event loop: resolve this batch's futures (a cancelled caller, e.g. a device that went away, is
    skipped)."""
    for fut, i in futures:
        if fut.done():
            continue
        if isinstance(results, BaseException):
            fut.set_exception(results)
        else:
            fut.set_result(results[i])

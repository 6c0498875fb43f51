"""Micro-batching of concurrent async calls into one synchronous batch call on a worker thread.

While one batch runs, the calls that arrive queue up and go together in the next one; nothing waits for a
batch to fill (no timer), so a lone call goes out at once and a burst is amortised. The batch function runs on
a dedicated thread, never on the event loop: used for the hypernetwork's batched forward (one ``[K, E]``
matmul instead of K) and for joins (one SQLite transaction per batch instead of one commit per client)."""
from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


class MicroBatcher(Generic[T, R]):
    """``await batcher.submit(key, item)`` -> ``fn(key, [items...])[i]`` for this item. Calls with different
    keys never share a batch; batches of one key run one at a time, in arrival order."""

    def __init__(self, fn: Callable[[Hashable, list[T]], Sequence[R]], max_batch: int = 64,
                 name: str = "batcher") -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        self.fn, self.max_batch = fn, max_batch
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=name)
        self._queues: dict[Hashable, list[tuple[T, asyncio.Future[R]]]] = {}
        self._busy: set[Hashable] = set()
        self.batches = 0  # how many batch calls ran (observability, tests)

    async def submit(self, key: Hashable, item: T) -> R:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[R] = loop.create_future()
        self._queues.setdefault(key, []).append((item, fut))
        if key not in self._busy:
            self._busy.add(key)
            loop.create_task(self._drain(key))
        return await fut

    async def _drain(self, key: Hashable) -> None:
        queue = self._queues[key]
        loop = asyncio.get_running_loop()
        try:
            while queue:
                batch = queue[:self.max_batch]
                del queue[:self.max_batch]
                self.batches += 1
                try:
                    results = await loop.run_in_executor(self._pool, self.fn, key, [item for item, _ in batch])
                    if len(results) != len(batch):
                        raise RuntimeError(f"batch function returned {len(results)} results for {len(batch)} items")
                except Exception as exc:  # surfaced to every waiting call of this batch
                    for _, fut in batch:
                        if not fut.done():
                            fut.set_exception(exc)
                    continue
                for (_, fut), result in zip(batch, results):
                    if not fut.done():  # a cancelled caller (client went away) is skipped
                        fut.set_result(result)
        finally:
            self._busy.discard(key)
            if not queue:
                self._queues.pop(key, None)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

"""MicroBatcher: concurrent calls coalesce into batches on a worker thread, each call gets its own result."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from fl_server.service.batching import MicroBatcher


def test_concurrent_calls_share_batches_and_keep_their_results() -> None:
    seen: list[tuple[str, list[int], str]] = []

    def square(key: object, items: list[int]) -> list[int]:
        seen.append((str(key), list(items), threading.current_thread().name))
        time.sleep(0.02)  # while this batch runs, the next calls queue up
        return [i * i for i in items]

    async def main() -> list[int]:
        b: MicroBatcher[int, int] = MicroBatcher(square, max_batch=8, name="sq")
        try:
            return await asyncio.gather(*(b.submit("k", i) for i in range(30)))
        finally:
            b.close()

    out = asyncio.run(main())
    assert out == [i * i for i in range(30)]
    assert len(seen) < 30 and max(len(items) for _, items, _ in seen) <= 8  # batched, bounded
    assert [i for _, items, _ in seen for i in items] == list(range(30))  # arrival order
    assert all(name.startswith("sq") for *_, name in seen)  # never on the event loop's thread


def test_keys_are_not_mixed_and_errors_reach_their_batch_only() -> None:
    def fn(key: object, items: list[int]) -> list[str]:
        if key == "bad":
            raise ValueError("boom")
        return [f"{key}:{i}" for i in items]

    async def main() -> tuple[list[str], BaseException | None]:
        b: MicroBatcher[int, str] = MicroBatcher(fn)
        try:
            good = asyncio.gather(*(b.submit("a", i) for i in range(5)))
            bad = b.submit("bad", 1)
            res = await asyncio.gather(good, bad, return_exceptions=True)
            return res[0], res[1] if isinstance(res[1], BaseException) else None
        finally:
            b.close()

    good, err = asyncio.run(main())
    assert good == [f"a:{i}" for i in range(5)]
    assert isinstance(err, ValueError)


def test_wrong_result_count_is_an_error() -> None:
    async def main() -> None:
        b: MicroBatcher[int, int] = MicroBatcher(lambda _, items: items[:-1])
        try:
            await b.submit("k", 1)
        finally:
            b.close()

    with pytest.raises(RuntimeError, match="returned 0 results for 1 items"):
        asyncio.run(main())

"""Hand the heap memory a personalisation freed back to the operating system.

A personalisation allocates and frees tens of MB (onnxruntime's step outputs, the weight copies); glibc keeps
freed blocks in its heap, fragmented, so the peak memory of a device that personalises again and again crept up
call after call (about 10 MB over a dozen calls of ConvNet's FedTTA step); ``malloc_trim`` after each call keeps
it within a few MB of the first call's. A no-op where the C library has no ``malloc_trim`` (not glibc, not
Linux)."""
from __future__ import annotations

import ctypes
import sys
from typing import Any, Callable


def _find_malloc_trim() -> Callable[[int], Any] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)  # the C library this process already runs on: nothing new is loaded
    except OSError:
        return None
    trim = getattr(libc, "malloc_trim", None)  # glibc's; musl has none
    if trim is not None:
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


_MALLOC_TRIM = _find_malloc_trim()


def release_free_heap() -> None:
    """Return the heap's free pages to the operating system (glibc), so repeated personalisations do not grow
    the process."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)

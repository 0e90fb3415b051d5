"""Host memory handed back to the system while a model is built piece by piece.

glibc keeps freed heap memory for reuse instead of returning it, and tensors under its mmap
threshold (which grows up to 32 MiB as large blocks are freed: every FLUX projection is 18-72 MiB in
bf16, many below it) come from the heap. Streaming a model block by block frees one block's
full-precision tensors per block; without a trim the process's resident memory still climbs to
about the whole model's size, though the live tensors never do. ``malloc_trim(0)`` releases free
heap pages (glibc >= 2.8 also releases free pages inside the heap, not only at its top).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys


@functools.cache
def _libc_trim():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):  # musl and other libcs have no malloc_trim
        return None


def release_free_memory() -> bool:
    """Return free heap memory to the system (glibc only); True if anything was released."""
    trim = _libc_trim()
    return bool(trim(0)) if trim is not None else False

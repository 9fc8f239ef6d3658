"""Handing freed heap memory back to the system.

glibc keeps memory freed by the process in its malloc arenas for reuse: after a burst of work
(compiling grammars, a large batch) the process's RSS stays at its peak. `trim_heap` returns the
free part of every arena (glibc's malloc_trim); elsewhere it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Any

_LIBC: Any = None


def trim_heap() -> None:
    global _LIBC
    if _LIBC is None:
        name = ctypes.util.find_library("c")
        _LIBC = ctypes.CDLL(name) if name else False
    if _LIBC and hasattr(_LIBC, "malloc_trim"):
        _LIBC.malloc_trim(0)

"""Hands back the resident pages of a float weight read from a memory-mapped file once
it has been quantized, so loading a model never holds the float checkpoint.

Loaders (transformers' safetensors reader, numpy's memmap) map the whole file; every
page a quantizer reads stays resident in that mapping, counted in the process's RSS,
for as long as anything keeps the mapping open (in transformers, any float tensor the
model keeps, such as an embedding). ``release(address, nbytes)`` tells the kernel the
pages are not needed (``madvise(MADV_DONTNEED)``), only where that cannot lose data:
the range lies in a mapping of a regular file and, where the mapping is private, no page
of the range has been written (each present page is still the file's page, per
``/proc/self/pagemap``), so the kernel re-reads it from the file if it is touched again.
Anything else (anonymous memory, a page copied on write, a platform without madvise or
pagemap) is left alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import sys

import numpy as np

__all__ = ["is_mapped", "release", "release_pages", "trim"]

_MADV_DONTNEED = 4
_PAGE = mmap.PAGESIZE


def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


_LIBC = _libc()


def _madvise():
    fn = getattr(_LIBC, "madvise", None)
    if fn is None:
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_MADVISE = _madvise()


def _file_mapping(start: int, end: int) -> str | None:
    """The permissions of the file mapping holding [start, end), or None (not one mapping
    of a regular file)."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                lo, hi = (int(v, 16) for v in fields[0].split("-"))
                if lo <= start and end <= hi:
                    path = fields[5].strip() if len(fields) > 5 else ""
                    ok = path.startswith("/") and not path.endswith("(deleted)")
                    return fields[1] if ok else None
    except OSError:
        return None
    return None


_PRESENT = np.uint64(1 << 63)
_FILE_PAGE = np.uint64(1 << 61)


def _unwritten(start: int, end: int) -> bool:
    """Whether every present page of [start, end) is still the file's own page (bit 61 of
    its pagemap entry): none was copied on write."""
    try:
        with open("/proc/self/pagemap", "rb") as f:
            f.seek(start // _PAGE * 8)
            entries = np.frombuffer(f.read((end - start) // _PAGE * 8), np.uint64)
    except OSError:
        return False
    if entries.size != (end - start) // _PAGE:
        return False
    present = (entries & _PRESENT) != 0
    return bool(np.all((entries[present] & _FILE_PAGE) != 0))


def release(address: int, nbytes: int) -> int:
    """Drop this process's resident pages wholly inside [address, address + nbytes) if
    they are a file's unwritten pages; the bytes the caller sees do not change.
    Returns the number of bytes released (0 when nothing was safe to release)."""
    if _MADVISE is None or nbytes <= 0:
        return 0
    lo = -(-address // _PAGE) * _PAGE  # whole pages only: a neighbour's bytes share the edges
    hi = (address + nbytes) // _PAGE * _PAGE
    if hi <= lo:
        return 0
    perms = _file_mapping(lo, hi)
    if perms is None or not perms.startswith("r") or (perms[3] == "p" and not _unwritten(lo, hi)):
        return 0
    if _MADVISE(lo, hi - lo, _MADV_DONTNEED) != 0:
        return 0
    return hi - lo


def _malloc_trim():
    fn = getattr(_LIBC, "malloc_trim", None)  # glibc only
    if fn is None:
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


_MALLOC_TRIM = _malloc_trim()


def trim() -> None:
    """Return the C heap's free pages to the system (glibc's ``malloc_trim``): a load's
    transient copies, freed, otherwise stay resident in the heap for the process's life."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def is_mapped(array) -> bool:
    """Whether ``array`` is a view of a memory-mapped file (np.memmap, Reader.view)."""
    base = array
    while isinstance(base, np.ndarray):
        base = base.base
    return isinstance(base, mmap.mmap)


def release_pages(array: np.ndarray) -> int:
    """``release`` for a numpy array (a view of ``load_checkpoint(..., mapped=True)`` once
    its data is copied): its file's pages go back to the system; the values it shows do not
    change (they are read again from the file if used). Returns the bytes released."""
    if not isinstance(array, np.ndarray) or not array.flags.c_contiguous:
        return 0
    return release(array.ctypes.data, array.nbytes)

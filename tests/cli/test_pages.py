"""q4/_src/pages.py: a quantized float weight's pages go back to the system only where
the bytes cannot change (a file's unwritten pages), and the loaders use it."""

from __future__ import annotations

import mmap
import sys

import numpy as np
import pytest

from q4._src import pages

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise + /proc/self/pagemap: Linux")

N = 64 * mmap.PAGESIZE


def _resident(arr: np.ndarray) -> int:
    """Resident bytes of arr's mapping (Rss of its /proc/self/smaps entry)."""
    addr = arr.ctypes.data
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(v, 16) for v in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "Rss:":
                return int(line.split()[1]) * 1024
    raise AssertionError("mapping not found")


@pytest.fixture
def weights_file(tmp_path):
    data = np.random.default_rng(0).integers(0, 255, N, dtype=np.uint8)
    path = tmp_path / "w.bin"
    data.tofile(path)
    return path, data


@pytest.mark.parametrize("mode", ["r", "c"])  # read-only shared; private copy-on-write (as torch maps safetensors)
def test_file_pages_are_released_and_read_back(weights_file, mode):
    path, data = weights_file
    m = np.memmap(path, np.uint8, mode=mode)
    assert int(m.astype(np.int64).sum()) == int(data.astype(np.int64).sum())  # touch every page
    before = _resident(m)
    assert before >= N // 2
    released = pages.release(m.ctypes.data, m.nbytes)
    assert released == N  # the file starts page-aligned: every page
    assert _resident(m) < before
    np.testing.assert_array_equal(np.asarray(m), data)  # re-read from the file


def test_written_private_pages_are_kept(weights_file):
    path, data = weights_file
    m = np.memmap(path, np.uint8, mode="c")
    m[5 * mmap.PAGESIZE] = data[5 * mmap.PAGESIZE] ^ 0xFF  # one page copied on write
    assert pages.release(m.ctypes.data, m.nbytes) == 0
    assert m[5 * mmap.PAGESIZE] == data[5 * mmap.PAGESIZE] ^ 0xFF
    # the range beside the written page is still the file's: only whole unwritten pages go
    assert pages.release(m.ctypes.data + 8 * mmap.PAGESIZE, 8 * mmap.PAGESIZE) == 8 * mmap.PAGESIZE
    np.testing.assert_array_equal(np.asarray(m[8 * mmap.PAGESIZE :]), data[8 * mmap.PAGESIZE :])


def test_anonymous_memory_is_never_released():
    a = np.arange(N, dtype=np.uint8)
    assert pages.release(a.ctypes.data, a.nbytes) == 0
    np.testing.assert_array_equal(a, np.arange(N, dtype=np.uint8))


def test_partial_pages_stay(weights_file):
    path, _ = weights_file
    m = np.memmap(path, np.uint8, mode="r")
    # a range that covers no whole page releases nothing; its edges' pages are a neighbour's
    assert pages.release(m.ctypes.data + 1, mmap.PAGESIZE) == 0
    assert pages.release(m.ctypes.data + 1, 3 * mmap.PAGESIZE) == mmap.PAGESIZE * 2


def test_mapped_checkpoint_equals_read(tmp_path):
    import q4

    rng = np.random.default_rng(1)
    tensors = {"a": rng.standard_normal((64, 96)).astype(np.float32), "b": rng.integers(0, 255, 1000, dtype=np.uint8)}
    q4.checkpoint.save_file(tensors, tmp_path / "m.safetensors")
    read = q4.checkpoint.load_checkpoint(tmp_path)
    mapped = q4.checkpoint.load_checkpoint(tmp_path, mapped=True)
    assert sorted(mapped) == sorted(read)
    for k in read:
        assert not mapped[k].flags.writeable
        np.testing.assert_array_equal(mapped[k], read[k])
        q4.checkpoint.release_pages(mapped[k])
        np.testing.assert_array_equal(mapped[k], read[k])  # read again from the file

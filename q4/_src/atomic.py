"""Atomic publishing of files: a file is written to a temporary beside its
target and renamed over it only when complete, so an interrupted write never
replaces a good file with a partial one.

Temporary files are named ".<target name>.q4tmp-<pid>-<8 hex digits>" in the
target's directory, created with mode 0o666 (so the umask applies, as for any
new file, and the published file keeps that mode) and held under an exclusive
flock until published or removed. A process killed with SIGKILL leaves its
temporary behind; the next write to the same target removes every such file
whose pid is not alive and whose lock is free. The safetensors Writer
(container.py) and the ``q4 quantize`` command's other outputs (convert.py)
publish through here.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import secrets
import stat
from pathlib import Path


class CheckpointError(ValueError):
    """A checkpoint file is truncated, corrupted or inconsistent, or cannot be
    written (the message names the tensor or the file)."""


_TMP_TAG = ".q4tmp-"
_TMP_RE = re.compile(r"\.(?P<name>.+)\.q4tmp-(?P<pid>[0-9]+)-[0-9a-f]{8}")


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True  # someone else's process (or not a pid): leave its file alone
    return True


def remove_stale_temporaries(path) -> list[Path]:
    """Remove the temporaries left beside ``path`` by q4 processes that died
    before publishing it (see above); returns what was removed."""
    path = Path(path)
    directory = path.parent if str(path.parent) else Path(".")
    prefix = f".{path.name}{_TMP_TAG}"
    removed: list[Path] = []
    try:
        names = [n for n in os.listdir(directory) if n.startswith(prefix)]
    except OSError:
        return removed
    for name in names:
        m = _TMP_RE.fullmatch(name)
        if m is None or m["name"] != path.name or _pid_alive(int(m["pid"])):
            continue
        tmp = directory / name
        try:
            fd = os.open(tmp, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            if not os.path.isfile(tmp) or not _try_lock(fd):
                continue
            os.unlink(tmp)
            removed.append(tmp)
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def create_temporary(path: Path) -> tuple[int, Path]:
    """A new locked temporary file beside ``path`` (after removing stale ones)."""
    directory = path.parent if str(path.parent) else Path(".")
    remove_stale_temporaries(path)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    for _ in range(100):
        tmp = directory / f".{path.name}{_TMP_TAG}{os.getpid()}-{secrets.token_hex(4)}"
        try:
            fd = os.open(tmp, flags, 0o666)
        except FileExistsError:
            continue
        except OSError as e:
            raise CheckpointError(f"cannot write {path}: {e.strerror or e}") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            pass  # a file system without locks: the pid in the name still protects it on this host
        return fd, tmp
    raise CheckpointError(f"cannot write {path}: no free temporary name")


def rename_into_place(tmp: Path, path: Path) -> None:
    """Rename ``tmp`` over ``path`` and make the rename durable."""
    os.replace(tmp, path)
    try:
        dfd = os.open(path.parent if str(path.parent) else ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        os.fsync(dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)


def _through_temporary(path, fill, copy_stat_from=None) -> None:
    """Publish ``path`` from a temporary file that ``fill(f)`` writes (the same
    naming, mode and clean-up as container.Writer); with ``copy_stat_from``, its mode
    bits and times are copied first."""
    path = Path(path)
    fd, created = create_temporary(path)
    tmp: Path | None = created
    try:
        with os.fdopen(fd, "wb", closefd=False) as f:
            fill(f)
            f.flush()
            os.fsync(f.fileno())
        if copy_stat_from is not None:
            import shutil

            shutil.copystat(copy_stat_from, created)
        rename_into_place(created, path)
        tmp = None
    finally:
        os.close(fd)
        if tmp is not None:
            discard(tmp)


def write_atomic(path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename."""
    _through_temporary(path, lambda f: f.write(data))


def copy_atomic(src, path) -> None:
    """Copy the regular file ``src`` to ``path`` (contents, mode bits and
    times) through a temporary file. ``src`` is opened without following a
    link in its last component and without blocking; anything but a regular
    file (a FIFO, a device, a link swapped in meanwhile) raises CheckpointError
    before a byte is read."""
    import shutil

    real = os.path.realpath(src)
    try:
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise CheckpointError(f"cannot copy {src}: {e.strerror or e}") from e
    with os.fdopen(fd, "rb") as s:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise CheckpointError(f"cannot copy {src}: not a regular file")
        _through_temporary(path, lambda f: shutil.copyfileobj(s, f, 1 << 20), copy_stat_from=real)


def discard(tmp) -> None:
    try:
        os.unlink(tmp)
    except FileNotFoundError:
        pass

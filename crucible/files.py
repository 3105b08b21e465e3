"""Writing a file so that a reader sees the old version or the new one, never
a torn one: write beside it, optionally fsync, rename over it."""

from __future__ import annotations

import os


def atomic_write(path: str, data: str | bytes, fsync: bool = True, mode: int | None = None) -> None:
    """Replace ``path`` with ``data`` atomically (a process killed mid-write
    leaves the previous file); ``fsync`` makes it survive a machine crash too;
    ``mode`` sets the new file's permissions before it appears."""
    tmp = f"{path}.tmp{os.getpid()}"
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    fd = os.open(tmp, flags, 0o666 if mode is None else mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def dir_problem(path: str) -> str | None:
    """Why ``path`` is not a directory and cannot become one (a file is there,
    or at a folder above it), or None: a directory, or a path that
    ``os.makedirs`` can create."""
    p = os.path.abspath(path)
    if os.path.exists(p):
        return None if os.path.isdir(p) else "not a directory"
    while p != os.path.dirname(p):
        p = os.path.dirname(p)
        if os.path.exists(p):
            return None if os.path.isdir(p) else f"{p} is not a directory"
    return None

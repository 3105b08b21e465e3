"""Writing a file so that a reader sees the old version or the new one, never
a torn one: write beside it, optionally fsync, rename over it."""

from __future__ import annotations

import errno
import os
import time

FULL = (errno.ENOSPC, errno.EDQUOT)     # a write refused for want of room


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


def write_held(fd: int, held: bytearray) -> None:
    """Write `held` to `fd`, taking what the OS took off its front: on an
    OSError (a full disk) the rest stays in `held`, to the byte, for the next
    try (a record the disk cut is finished then, never written twice)."""
    while held:
        del held[:os.write(fd, held)]


def write_even_when_full(path: str, data: str) -> None:
    """``atomic_write`` for a file of a few bytes that a restarted coordinator
    must write on a full disk too (its incarnation, its address): where the
    disk has no room for the new copy, the file there is overwritten in
    place, in one write within the block it already has (no new one is
    needed), then cut to the new length. Not atomic then: a reader between
    the write and the cut could see old bytes past the new end, which the
    two files never have: a restart writes the same address, and an
    incarnation that only grows."""
    try:
        atomic_write(path, data)
    except OSError as e:
        raw = data.encode()
        if e.errno not in FULL or not os.path.exists(path) or len(raw) > 4096:
            raise
        fd = os.open(path, os.O_WRONLY)
        try:
            os.pwrite(fd, raw, 0)
            if os.fstat(fd).st_size > len(raw):
                os.ftruncate(fd, len(raw))
            os.fsync(fd)
        finally:
            os.close(fd)


def lock_held(path: str) -> bool:
    """Another process holds the flock on the file at ``path`` (a running
    job's ``coordinator.lock``). Nothing is made: a missing file is no lock."""
    import fcntl

    try:
        f = open(path, "rb")
    except OSError:
        return False
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(f, fcntl.LOCK_UN)
    return False


CKPT_LOCK = ".lock"     # in checkpoints/: held by the one job that writes there (hold_checkpoints)


def take_lock(path: str, owner: str):
    """Hold the flock on ``path`` (made when missing) and write ``owner`` into
    it, for ``lock_owner`` to name; the open file, which holds the lock until
    it is closed or this process ends. BlockingIOError when another process
    holds it (tried again twice, 50 ms apart: ``lock_held`` takes it for a
    moment to look). The file held is open for reading only: one open for
    writing for the job's life kept its file system from being remounted
    read-only (EBUSY)."""
    import fcntl

    f = os.fdopen(os.open(path, os.O_RDONLY | os.O_CREAT, 0o644), "rb", buffering=0)
    try:
        for left in (2, 1, 0):
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not left:
                    raise
                time.sleep(0.05)
    except BaseException:
        f.close()
        raise
    raw = (owner + "\n").encode()
    try:    # (written over the old owner, then cut: on a full disk the block the file has takes it)
        fd = os.open(path, os.O_WRONLY)
        try:
            os.pwrite(fd, raw, 0)
            os.ftruncate(fd, len(raw))
        finally:
            os.close(fd)
    except OSError:
        pass          # (no room at all, or read-only: the lock holds all the same; a refusal names no owner)
    return f


def lock_owner(path: str) -> str | None:
    """What the process holding the flock on ``path`` wrote there (``take_lock``;
    "" where it wrote nothing), or None when nobody holds it."""
    if not lock_held(path):
        return None
    try:
        with open(path) as f:
            return f.read().strip()
    except (OSError, UnicodeDecodeError):
        return ""


def hold_checkpoints(run_dir: str):
    """Take ``run_dir``'s checkpoints/.lock for this process, naming it and the
    run directory there ("pid run_dir"): the one job that saves, prunes and
    cleans that folder (it may be shared, a symlink: two jobs there delete
    each other's checkpoints). The open file (``take_lock``); BlockingIOError
    when another process holds it (``checkpoints_holder`` says who), OSError
    when the folder cannot be written."""
    path = os.path.join(run_dir, "checkpoints", CKPT_LOCK)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    return take_lock(path, f"{os.getpid()} {run_dir}")


def checkpoints_holder(run_dir: str) -> tuple[str, str] | None:
    """(pid, run directory) of the job holding ``run_dir``'s checkpoints/.lock
    ("" for what it could not write), or None when nobody holds it."""
    owner = lock_owner(os.path.join(run_dir, "checkpoints", CKPT_LOCK))
    if owner is None:
        return None
    pid, _, other = owner.partition(" ")
    return pid, other


def checkpoints_in_use(shown: str, run_dir: str, holder: tuple[str, str]) -> str:
    """The refusal of a job whose checkpoints/ ``holder`` (``checkpoints_holder``)
    holds; ``shown``: the run directory as the user gave it."""
    other = holder[1]
    if other and os.path.realpath(other) == os.path.realpath(run_dir):
        return (f"--run-dir {shown}: a job is running there (it holds checkpoints/{CKPT_LOCK}); let it end, "
                f"or choose another --run-dir")
    root = os.path.join(run_dir, "checkpoints")
    real = os.path.realpath(root)
    return (f"--run-dir {shown}: its checkpoints/ {'(' + real + ') ' if real != root else ''}is in use by "
            f"{'the job in ' + other if other else 'another job'} (it holds checkpoints/{CKPT_LOCK}); let it end, "
            f"or give each run a checkpoints/ of its own")


def dir_problem(path: str, make: bool = False, room: bool = True) -> str | None:
    """Why ``path`` is not a directory and cannot become one (a file is there,
    or at a folder above it), or None: a directory, or a path that
    ``os.makedirs`` can create. With ``make``, also whether the OS lets this
    process create folders there: one folder of a name of its own is made in
    ``path`` (when it exists) or in the deepest folder above it that exists,
    and removed again (``/proc/x``, a read-only file system), and, with
    ``room``, whether its file system has room. Nothing else is made or
    removed, so another launch making the same folders at the same time is
    never undone."""
    p = os.path.abspath(path)
    if os.path.exists(p):
        if not os.path.isdir(p):
            return "not a directory"
        return _probe(p, "cannot write in it", room) if make else None
    top = p
    while top != os.path.dirname(top):
        top = os.path.dirname(top)
        if os.path.exists(top):
            if not os.path.isdir(top):
                return f"{top} is not a directory"
            break
    return _probe(top, "cannot create it", room) if make else None


def _probe(folder: str, what: str, room: bool) -> str | None:
    """Make and remove a folder of this process's own in `folder`: the OS's
    reason when it refuses, else None; or that its file system is full (a
    folder takes no data blocks: on a full disk the probe passed, and the
    first file written after it, the token, ended the launch on a traceback)."""
    probe = os.path.join(folder, f".crucible-probe-{os.getpid()}-{os.urandom(4).hex()}")
    try:
        os.mkdir(probe)
    except OSError as e:
        return f"{what}: {folder}: {e.strerror or e}"
    try:
        os.rmdir(probe)
    except OSError:
        pass
    free = free_bytes(folder) if room else None
    if free is not None and free < MIN_FREE_BYTES:
        return f"{what}: {folder}: its file system is full ({free // 1024} KiB free)"
    return None


MIN_FREE_BYTES = 1 << 20    # a run directory's first files (token, state, logs, events) need far less


def free_bytes(path: str) -> int | None:
    """Bytes this process may still write on the file system of ``path``
    (root may use the blocks reserved for it), or None where it cannot tell
    (a FUSE file system that does not implement statfs says 0 blocks in all)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    if st.f_blocks == 0:
        return None
    return (st.f_bfree if os.geteuid() == 0 else st.f_bavail) * st.f_frsize

"""Phase 2 of a save, off the training process: write a shard from a shared region.

A snapshot (``crucible.checkpoint.snapshot``) copies a worker's state into
one shared-memory region laid out exactly as the data region of a shard file
(``crucible.checkpoint.shard``). Persisting it is then one sequential write
by ``shard.write``:

    prefix (magic, header JSON, padding)  |  region[0:data_bytes]  |  trailer

byte for byte what ``shard.write_shard`` writes for the same state.

Where the write runs:

* ``ProcessPersister`` (the default on Linux): a small child process
  (``python -m crucible.checkpoint.persister``, no torch, started with
  ``subprocess``) that maps the same region (a ``memfd`` handed over with
  ``pass_fds``) and writes shards on request. The training process keeps its
  GIL and its CPU caches; the child can die (a SIGKILL, an I/O error) without
  taking the worker with it: the save fails, the coordinator aborts that
  checkpoint, and the next save starts a fresh child. The child dies with its
  parent (``PR_SET_PDEATHSIG`` and EOF on its stdin), so it never outlives it,
  and ignores SIGTERM and SIGINT (a signal to the whole process group must not
  cut the shard its worker is still finishing). A child that stays stopped
  (SIGSTOP) while it has a request is killed (``STOPPED_POLLS``): its write
  would never end, and every later save waits for it first.
* ``ThreadPersister``: the same write on a thread of the training process
  (other platforms, ``checkpoint.persister = thread``).

Requests and replies are JSON lines over the child's stdin and stdout.
No torch here.
"""

from __future__ import annotations

import base64
import json
import mmap
import os
import select
import signal
import subprocess
import sys
import threading
from pathlib import Path

from .. import procs
from . import shard

POLL_S = 0.5          # how often a worker waiting for its persister looks at the child's state
STOPPED_POLLS = 6     # seen stopped (SIGSTOP) this many polls in a row: killed (a whole job frozen and
                      # woken together is seen stopped in one poll at most)


class PersistError(RuntimeError):
    """A shard could not be persisted (the writer died or failed)."""


class ThreadPersister:
    """Writes on the calling thread (the caller runs it in the background)."""

    kind = "thread"

    def __init__(self) -> None:
        self.region = None
        self.pid = os.getpid()

    def attach(self, fd: int, size: int, region) -> None:
        self.region = region

    def write(self, prefix: bytes, data_bytes: int, directory: str, name: str, delay_s: float = 0.0) -> dict:
        return shard.write(directory, name, prefix, shard.region_chunks(self.region, data_bytes), delay_s)

    def close(self) -> None:
        self.region = None


class ProcessPersister:
    """A child process that writes shards from a shared region (see the module
    docstring). ``write`` blocks until the child answers; call it from a
    background thread. Not for concurrent use (one save in flight)."""

    kind = "process"

    def __init__(self, on_start=None) -> None:
        self.proc: subprocess.Popen | None = None
        self.fd: int | None = None
        self.size = 0
        self.on_start = on_start        # called with the child's pid
        self._seq = 0
        self._lock = threading.Lock()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def attach(self, fd: int, size: int, region) -> None:
        """A new region (a new layout): the next write starts a child that maps it."""
        with self._lock:
            if fd != self.fd or size != self.size:
                self._stop()
                self.fd, self.size = fd, size

    def _start(self) -> None:
        env = dict(os.environ)
        env["CRUCIBLE_PERSISTER_PARENT"] = str(os.getpid())
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "crucible.checkpoint.persister", "--fd", str(self.fd), "--size", str(self.size)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None, pass_fds=(self.fd,), env=env,
            close_fds=True)
        if self.on_start is not None:
            self.on_start(self.proc.pid)

    def _stop(self) -> None:
        p, self.proc = self.proc, None
        if p is None:
            return
        try:
            p.stdin.close()
        except OSError:
            pass
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        for s in (p.stdout,):
            try:
                s.close()
            except OSError:
                pass

    def write(self, prefix: bytes, data_bytes: int, directory: str, name: str, delay_s: float = 0.0) -> dict:
        with self._lock:
            if self.fd is None:
                raise PersistError("no region attached")
            if self.proc is None or self.proc.poll() is not None:
                self._reap()
                self._start()
            self._seq += 1
            req = {"id": self._seq, "prefix": base64.b64encode(prefix).decode("ascii"), "data_bytes": data_bytes,
                   "dir": str(directory), "name": name, "delay_s": delay_s}
            proc = self.proc
        stopped = False
        try:
            stopped = not self._send(proc, (json.dumps(req) + "\n").encode())
            line = b"" if stopped else self._answer(proc)
            stopped = stopped or line is None
        except (OSError, ValueError):
            line = b""
        if not line:
            if stopped:
                proc.kill()
            code = proc.wait()
            with self._lock:
                self._reap()
            if stopped:
                raise PersistError(f"persister process {proc.pid} was stopped (SIGSTOP) for "
                                   f"{POLL_S * STOPPED_POLLS:.0f}s while writing {name}: killed")
            why = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
            raise PersistError(f"persister process {proc.pid} died ({why}) while writing {name}")
        try:
            rep = json.loads(line)
        except ValueError:
            raise PersistError(f"persister process answered garbage: {line[:100]!r}") from None
        if rep.get("id") != req["id"]:
            raise PersistError(f"persister answered request {rep.get('id')} for {req['id']}")
        if not rep.get("ok"):
            raise PersistError(f"persister could not write {name}: {rep.get('error')}")
        return {"name": rep["name"], "bytes": int(rep["bytes"]), "checksum": rep["checksum"]}

    @staticmethod
    def _ready(proc, read=(), write=()) -> bool:
        """Wait until a pipe to or from ``proc`` is ready (True), or the child
        has been seen stopped (SIGSTOP) STOPPED_POLLS polls in a row (False)."""
        polls = 0
        while not any(select.select(read, write, [], POLL_S)[:2]):
            polls = polls + 1 if procs.state(proc.pid) == "T" else 0
            if polls >= STOPPED_POLLS:
                return False
        return True

    def _send(self, proc, data: bytes) -> bool:
        """Write a request, a pipe's atomic size at a time (a header of many
        tensors outgrows the pipe, and a stopped child reads none of it).
        False: the child stayed stopped."""
        fd, view = proc.stdin.fileno(), memoryview(data)
        while view:
            if not self._ready(proc, write=[fd]):
                return False
            view = view[os.write(fd, view[:select.PIPE_BUF]):]
        return True

    def _answer(self, proc) -> bytes | None:
        """The child's answer line (b"" if it died); None if it stayed stopped."""
        return proc.stdout.readline() if self._ready(proc, read=[proc.stdout]) else None

    def _reap(self) -> None:
        p, self.proc = self.proc, None
        if p is not None:
            for s in (p.stdin, p.stdout):
                try:
                    s.close()
                except OSError:
                    pass
            try:
                p.wait(timeout=1)
            except subprocess.TimeoutExpired:
                p.kill()

    def close(self) -> None:
        with self._lock:
            self._stop()


# ---------------------------------------------------------------- the child


def _die_with_parent() -> None:
    parent = os.environ.get("CRUCIBLE_PERSISTER_PARENT")
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if parent and str(os.getppid()) != parent:
        os._exit(1)


def child_main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="crucible-persister")
    ap.add_argument("--fd", type=int, required=True)
    ap.add_argument("--size", type=int, required=True)
    args = ap.parse_args(argv)
    _die_with_parent()
    for sig in (signal.SIGINT, signal.SIGTERM):        # the parent decides when we stop (a SIGTERM
        signal.signal(sig, signal.SIG_IGN)             # to the whole group: it finishes the save in flight)
    region = mmap.mmap(args.fd, args.size, prot=mmap.PROT_READ) if args.size else b""
    out = sys.stdout.buffer
    for line in sys.stdin.buffer:
        req = None
        try:
            req = json.loads(line)
            data_bytes = int(req["data_bytes"])
            if not 0 <= data_bytes <= args.size:
                raise ValueError(f"data_bytes {data_bytes} outside the region ({args.size})")
            info = shard.write(req["dir"], req["name"], base64.b64decode(req["prefix"]),
                               shard.region_chunks(region, data_bytes), float(req.get("delay_s") or 0.0))
            rep = {"id": req.get("id"), "ok": True, **info}
        except Exception as e:  # answered, never fatal: the parent reports it
            rep = {"id": req.get("id") if isinstance(req, dict) else None, "ok": False,
                   "error": f"{type(e).__name__}: {e}"}
        out.write((json.dumps(rep) + "\n").encode())
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(child_main())

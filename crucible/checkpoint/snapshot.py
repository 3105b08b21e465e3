"""A save in two phases: snapshot (the only stall), then persist in the background.

1. *Snapshot*, ``Snapshotter.snapshot(state)``, on the training thread at a
   step boundary: the state's tensors are copied into one host ``Region``
   that is reused from save to save (reallocated only when the layout, i.e.
   a shape or dtype, changes). The region is laid out exactly as the data
   region of a shard file (``crucible.checkpoint.shard``: every blob at a
   64-byte-aligned offset, gaps zero), so nothing is copied again. On a GPU
   the region is pinned and the copies are asynchronous, synchronized
   before ``snapshot`` returns, so the snapshot is consistent when training
   resumes. It returns the shard's header.
2. *Persist*, ``Snapshotter.persist(header, directory, name)``: the region
   is written as a shard by a persister (``crucible.checkpoint.persister``:
   by default a small child process that maps the same region, so the
   training process keeps its GIL), with ``shard.write``. Call it off the
   training thread; it blocks until the shard is on disk.

At most one save is in flight: the next snapshot overwrites the region a
persist reads, so the caller waits for the previous persist first (the
worker's checkpointer does; see ``crucible.worker.checkpointing``).
"""

from __future__ import annotations

import gc
import logging
import mmap
import os
import time
from typing import Any

import numpy as np
import torch

from . import shard
from .persister import ProcessPersister, ThreadPersister

log = logging.getLogger("crucible.ckpt")

__all__ = ["LayoutEncoder", "Region", "Snapshotter"]


class LayoutEncoder(shard.Encoder):
    """The shard encoder, except that tensors are not copied: each is given its
    place in the data region and kept by reference for the snapshot."""

    def tensor_payload(self, t: torch.Tensor) -> tuple[Any, int]:
        return t.detach(), t.numel() * t.element_size()


class Region:
    """Host memory for snapshots, shared with the persister (a memfd on Linux)."""

    def __init__(self, size: int, pin: bool = False):
        self.size = size
        n = max(size, 1)
        if hasattr(os, "memfd_create"):
            self.fd = os.memfd_create("crucible-snapshot", os.MFD_CLOEXEC)
            os.ftruncate(self.fd, n)
            self.mm = mmap.mmap(self.fd, n)
        else:
            self.fd = -1
            self.mm = mmap.mmap(-1, n)
        self.u8 = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.u8.zero_()          # fault the pages in now, not during a snapshot
        self.pinned = False
        if pin:
            try:
                rc = torch.cuda.cudart().cudaHostRegister(self.u8.data_ptr(), n, 0)
                self.pinned = int(getattr(rc, "value", rc)) == 0
            except Exception as e:  # best effort: unpinned copies are still correct
                log.warning("could not pin the snapshot region: %s", e)

    def views(self, blobs: list[dict]) -> list[Any]:
        """One writable view of the region per blob (tensor, ndarray or bytes)."""
        out = []
        for meta in blobs:
            off, n = meta["offset"], meta["nbytes"]
            if meta["kind"] == "tensor":
                dtype = getattr(torch, meta["dtype"])
                if n == 0:
                    out.append(torch.empty(meta["shape"], dtype=dtype))
                else:
                    out.append(self.u8[off:off + n].view(dtype).view(meta["shape"]))
            elif meta["kind"] == "ndarray":
                dt = np.dtype(meta["dtype"])
                out.append(np.frombuffer(self.mm, dtype=np.uint8, count=n, offset=off).view(dt)
                           .reshape(meta["shape"]) if n else np.empty(meta["shape"], dtype=dt))
            else:
                out.append(memoryview(self.mm)[off:off + n])
        return out

    def close(self) -> None:
        if self.pinned:
            try:
                torch.cuda.cudart().cudaHostUnregister(self.u8.data_ptr())
            except Exception:
                pass
        self.u8 = None
        try:
            self.mm.close()
        except BufferError:      # a view is still alive somewhere: let the GC unmap it
            pass
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class Snapshotter:
    """Phase 1 and 2 for one state tree: ``snapshot(state)`` copies it into the
    reused region and returns the shard header; ``persist(header, dir, name)``
    writes the shard. ``persister``: ``"process"`` (a child process; Linux)
    or ``"thread"`` (the caller's thread). ``on_persister_start(pid)`` is
    called when a persister process starts. Stats: ``allocations`` (regions
    allocated so far), ``data_bytes`` (of the last snapshot)."""

    def __init__(self, persister: str = "process", pin: bool = False, on_persister_start=None):
        if persister == "process" and hasattr(os, "memfd_create"):
            self.persister = ProcessPersister(on_start=on_persister_start)
        else:
            self.persister = ThreadPersister()
        self.pin = pin
        self.region: Region | None = None
        self.sig = None
        self.dsts: list[Any] = []
        self.allocations = 0
        self.data_bytes = 0
        self.queued_s = 0.0      # of the last snapshot on a GPU: waiting for work queued before it
        self.copy_s = 0.0        # ... and the copies themselves (the pinned copy floor, in a job)

    def snapshot(self, state: dict) -> dict:
        # No cyclic garbage collection inside the stall: the small objects the
        # encoder makes could start a full collection here (hundreds of ms with
        # torch loaded); it runs on the next allocation after the snapshot instead.
        enabled = gc.isenabled()
        gc.disable()
        try:
            return self._snapshot(state)
        finally:
            if enabled:
                gc.enable()

    def _snapshot(self, state: dict) -> dict:
        enc = LayoutEncoder()
        tree = enc.encode(state)
        sig = [(m["kind"], m.get("dtype"), tuple(m.get("shape") or ()), m["offset"], m["nbytes"]) for m in enc.blobs]
        if sig != self.sig or self.region is None or self.region.size != enc.size:
            self._new_region(enc.size, enc.blobs)
            self.sig = sig
        cuda = any(isinstance(src, torch.Tensor) and src.device.type == "cuda" for src in enc.payloads)
        t0 = time.perf_counter()
        if cuda:   # what the GPU still has queued is not the snapshot's: measured apart
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        for dst, src in zip(self.dsts, enc.payloads):
            if isinstance(src, torch.Tensor):
                nb = src.device.type == "cuda"
                dst.copy_(src, non_blocking=nb and self.region.pinned)
            elif isinstance(src, np.ndarray):
                np.copyto(dst, src.reshape(dst.shape))
            else:
                dst[:] = bytes(src)
        if cuda:
            torch.cuda.synchronize()
        self.queued_s, self.copy_s = t1 - t0, time.perf_counter() - t1
        self.data_bytes = enc.size
        return enc.header(tree)

    def _new_region(self, size: int, blobs: list[dict]) -> None:
        self.dsts = []
        if self.region is not None:
            self.region.close()
        self.region = Region(size, pin=self.pin)
        self.dsts = self.region.views(blobs)
        self.persister.attach(self.region.fd, max(size, 1), self.region.mm)
        self.allocations += 1
        log.info("snapshot region: %d bytes in %d blobs (allocation %d)", size, len(blobs), self.allocations)

    def persist(self, header: dict, directory: str, name: str, delay_s: float = 0.0) -> dict:
        """Write the last snapshot as shard ``directory/name``; returns
        ``{"name", "bytes", "checksum"}``. Raises ``PersistError`` when the
        persister died or failed."""
        return self.persister.write(shard.prefix(header), header["data_bytes"], directory, name, delay_s)

    def close(self) -> None:
        self.persister.close()
        self.dsts = []
        if self.region is not None:
            self.region.close()
            self.region = None

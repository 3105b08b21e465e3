"""Where a worker computes, and in what precision.

``job.device`` (or ``worker --device``) is ``cpu``, ``cuda`` or ``cuda:N``.
``cuda`` spreads the slots over the visible GPUs round-robin, slot ``r*S+s``
on GPU ``(r*S+s) mod n``: one stage per GPU when there are at least R x S of
them, several stages per GPU otherwise (they share its memory and compute).

``train.precision``:

* ``fp32``: float32 everywhere (the CPU path, bitwise as before).
* ``tf32``: float32 tensors, matmuls and convolutions on TF32 tensor cores
  (CUDA only; on a CPU it is fp32).
* ``bf16``: ``torch.autocast`` to bfloat16 around each stage's forward (and
  the loss); parameters, gradients and optimizer state stay float32 (the
  master weights), the residual stream inside a stage stays float32, and each
  boundary is rounded to bfloat16 once, in both directions (half the bytes
  before any codec). A single process doing the same rounding at the same
  places computes exactly what the pipeline does (tests/test_equivalence.py).
"""

from __future__ import annotations

import contextlib
import os

import torch


class DeviceError(RuntimeError):
    """The device asked for is not there (a one-line reason)."""


def resolve(spec: str, replica: int, stage: int, stages: int) -> torch.device:
    """The torch device of slot (replica, stage) for `spec` (cpu | cuda | cuda:N)."""
    spec = (spec or "cpu").strip()
    if spec == "cpu":
        return torch.device("cpu")
    name, sep, index = spec.partition(":")
    if name != "cuda" or (sep and not (index.isascii() and index.isdigit())):   # (int("²") fails)
        raise DeviceError(f"device {spec!r}: must be cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise DeviceError(f"device {spec!r}: this torch ({torch.__version__}) sees no CUDA GPU; install a CUDA "
                          "build of torch in the venv (README, 'GPUs') or use --device cpu")
    n = torch.cuda.device_count()
    if sep:
        if int(index) >= n:
            raise DeviceError(f"device {spec!r}: only {n} GPU(s) visible (cuda:0..cuda:{n - 1})")
        return torch.device("cuda", int(index))
    return torch.device("cuda", (replica * stages + stage) % n)


def describe(device: torch.device) -> dict:
    """What `status` shows of a worker's device: its name and memory (MiB)."""
    if device.type != "cuda":
        return {"device": str(device)}
    props = torch.cuda.get_device_properties(device)
    mib = 1 << 20
    return {"device": str(device), "device_name": props.name,
            "mem_total_mb": round(props.total_memory / mib),
            "mem_allocated_mb": round(torch.cuda.memory_allocated(device) / mib),
            "mem_reserved_mb": round(torch.cuda.memory_reserved(device) / mib),
            "mem_peak_mb": round(torch.cuda.max_memory_allocated(device) / mib)}


def setup_deterministic(device: torch.device) -> None:
    """Bitwise-reproducible GPU kernels (for the GPU tests): call before the
    first cuBLAS call of the process."""
    if device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)


def setup_precision(precision: str, device: torch.device) -> None:
    """Process-wide switches of a precision (TF32 on CUDA)."""
    if device.type == "cuda":
        tf32 = precision == "tf32"
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32


def autocast(precision: str, device: torch.device):
    """The context a stage's forward (and loss) runs in."""
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def boundary_dtype(precision: str) -> torch.dtype:
    """The dtype activations and their gradients travel in between stages."""
    return torch.bfloat16 if precision == "bf16" else torch.float32


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (so a wall-clock split is true); no-op on a CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor (token ids, targets) on ``device`` without waiting for it.
    A copy from pageable memory to a GPU makes the host wait for every kernel
    already queued on the stream (the previous microbatch's backward); through
    page-locked memory the copy is only queued, and PyTorch's caching host
    allocator keeps the page-locked block until the copy is done. `t` is
    ordinary (pageable) memory: ``pin_memory()`` of a tensor already
    page-locked is that tensor, read later by the queued copy. Not the wire's
    reused per-thread buffers (``wire._pinned``): reusing one waits on the
    host for its last copy, which is queued behind the GPU's work; the
    allocator hands out another block instead. Off a GPU it is ``t.to(device)``."""
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)

"""A live progress line on a terminal, for long work (benchmarks, ``ckpt verify``).

Only when the stream (stderr by default) is a terminal: in a pipe, a file or
a test nothing is written, so ``--json`` output and logs stay clean. The line
is redrawn in place (``\\r``, at most ``HZ`` times a second) and erased by
``close``, so what the command prints afterwards starts on a clean line.
``CRUCIBLE_PROGRESS=0`` turns it off, ``=1`` forces it on (for a terminal
that does not say it is one).
"""

from __future__ import annotations

import os
import shutil
import sys
import time

HZ = 5.0


def on_terminal(stream=None) -> bool:
    forced = os.environ.get("CRUCIBLE_PROGRESS", "")
    if forced in ("0", "1"):
        return forced == "1"
    stream = stream or sys.stderr
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class Progress:
    """``update(done, note)`` redraws ``label: done/total (pct%) note  elapsed``;
    ``advance(n)`` adds n to what is done. Counts are shown divided by
    ``scale`` (e.g. bytes as MB: ``scale=1e6, unit=" MB"``)."""

    def __init__(self, label: str, total: float | None = None, unit: str = "", stream=None,
                 enabled: bool | None = None, scale: float = 1.0):
        self.stream = stream or sys.stderr
        self.enabled = on_terminal(self.stream) if enabled is None else enabled
        self.label, self.total, self.unit, self.scale = label, total, unit, scale
        self.done = 0.0
        self.t0 = time.monotonic()
        self.last = 0.0
        self.width = 0

    def update(self, done: float | None = None, note: str = "", force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self.last < 1.0 / HZ:
            return
        self.last = now
        parts = [self.label + ":"]
        if done is not None:
            self.done = done
            d = done / self.scale
            if self.total:
                parts.append(f"{_num(d)}/{_num(self.total / self.scale)}{self.unit} ({100 * done / self.total:.0f}%)")
            else:
                parts.append(f"{_num(d)}{self.unit}")
        if note:
            parts.append(note)
        parts.append(f"[{now - self.t0:.0f}s]")
        line = " ".join(parts)
        cols = shutil.get_terminal_size((100, 20)).columns - 1
        line = line[:cols]
        pad = max(0, self.width - len(line))
        self.width = len(line)
        try:
            self.stream.write("\r" + line + " " * pad)
            self.stream.flush()
        except (OSError, ValueError):
            self.enabled = False

    def advance(self, n: float, note: str = "") -> None:
        self.done += n
        self.update(self.done, note, force=bool(self.total) and self.done >= self.total)

    def close(self) -> None:
        if self.enabled and self.width:
            try:
                self.stream.write("\r" + " " * self.width + "\r")
                self.stream.flush()
            except (OSError, ValueError):
                pass
        self.width = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _num(x: float) -> str:
    if isinstance(x, float) and not x.is_integer():
        return f"{x:.1f}"
    return f"{int(x):,}"

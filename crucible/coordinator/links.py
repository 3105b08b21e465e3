"""Each stage boundary's throughput, for `crucible status` (no torch, no I/O).

Every committed step, each stage reports how many bytes it sent downstream
(``bytes_down``: activations, targets, token ids) and in all (``bytes_out``:
the rest went upstream, gradients) and how long its step took (``step_s``).
A boundary a -> b of a route then carries, per step, a's ``bytes_down`` one
way and b's ``bytes_out - bytes_down`` the other; divided by the step time,
that is the rate the link sustained over the step (Mbit/s, each direction).
On a link slower than the rest of the pipeline it is close to the link's
rate: the step time follows the link.
"""

from __future__ import annotations


class LinkRates:
    def __init__(self) -> None:
        self._last: dict[tuple[int, int], tuple[int, int, float]] = {}   # slot -> (down, up, step_s)

    def observe(self, replica: int, stage: int, ev: dict) -> None:
        try:
            out, down, step_s = int(ev["bytes_out"]), int(ev["bytes_down"]), float(ev["step_s"])
        except (KeyError, TypeError, ValueError):
            return
        if step_s > 0:
            self._last[(replica, stage)] = (down, max(0, out - down), step_s)

    def boundaries(self, replica: int, route: list[int]) -> list[dict]:
        out = []
        for a, b in zip(route, route[1:]):
            fa, fb = self._last.get((replica, a)), self._last.get((replica, b))
            out.append({
                "from": a, "to": b,
                "down_mbps": round(fa[0] * 8 / fa[2] / 1e6, 3) if fa else None,
                "up_mbps": round(fb[1] * 8 / fb[2] / 1e6, 3) if fb else None,
                "bytes_per_step": (fa[0] if fa else 0) + (fb[1] if fb else 0),
            })
        return out

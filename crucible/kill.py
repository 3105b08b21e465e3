"""`crucible kill --run-dir D r1s2`: SIGKILL one process of a local job (fault injection)."""

from __future__ import annotations

import json
import os
import signal
import sys

from crucible.slots import is_slot_name


def kill(run_dir: str, name: str, sig: int = signal.SIGKILL) -> int:
    if name != "coordinator" and not is_slot_name(name):
        print(f"crucible kill: {name!r} is not a worker name like r1s2 (or 'coordinator')", file=sys.stderr)
        return 2
    try:
        with open(os.path.join(run_dir, "pids.json")) as f:
            pids = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        print(f"crucible kill: cannot read {run_dir}/pids.json ({e}); is this a `crucible launch` run?",
              file=sys.stderr)
        return 1
    pid = pids.get(name)
    if not pid:
        print(f"crucible kill: no process {name} in {run_dir} (known: {', '.join(sorted(pids))})", file=sys.stderr)
        return 1
    try:
        os.kill(int(pid), sig)
    except ProcessLookupError:
        print(f"crucible kill: {name} (pid {pid}) is not running", file=sys.stderr)
        return 1
    print(f"killed {name} (pid {pid}) with {signal.Signals(sig).name}")
    return 0

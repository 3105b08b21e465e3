"""Continuous checkpointing (docs/architecture.md, "Checkpoints").

* ``policies``  when to save and which checkpoints to keep (no torch);
* ``storage``   the on-disk format: shards, manifest, crash-safe commit,
                verify, list, fallback, cleanup;
* ``snapshot``  ``AsyncSaver``: snapshot into reused host buffers (the only
                stall), persist on a background thread.

The torch-based names are loaded lazily, so ``crucible.checkpoint.policies``
can be imported (by the coordinator or ``crucible interval``) without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from .policies import (  # noqa: F401  (re-exported)
    AnyOf,
    BestN,
    CallablePolicy,
    CkptInfo,
    ContinuousPolicy,
    EveryNSeconds,
    EveryNSteps,
    FixedIntervalPolicy,
    KeepAll,
    LatestN,
    policy_from_config,
    save_policy_from_config,
    select_for_deletion,
)

_LAZY = {
    "CheckpointCorrupt": "storage",
    "write_shard": "storage",
    "read_shard": "storage",
    "load_shard": "storage",
    "read_manifest": "storage",
    "commit": "storage",
    "list_checkpoints": "storage",
    "verify": "storage",
    "latest_valid": "storage",
    "clean_tmp": "storage",
    "delete": "storage",
    "set_metrics": "storage",
    "shard_name": "storage",
    "step_dir": "storage",
    "tmp_dir": "storage",
    "AsyncSaver": "snapshot",
    "SaveInFlight": "snapshot",
}


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{mod}", __name__), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))

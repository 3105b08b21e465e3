"""Continuous checkpointing: the parts that know nothing of workers or coordinators.

* ``policies``   when to save and which checkpoints to keep (no torch);
* ``shard``      the bytes of one shard file: header, alignment, prefix,
                 trailer and digest; the one writer and the one reader;
* ``store``      a job's checkpoint directories: ``step_N`` and
                 ``.tmp-step_N``, the crash-safe commit with its manifest,
                 list, verify, fall back, delete, clean up;
* ``snapshot``   the snapshot region (``Region``, ``Snapshotter``): the
                 state copied into reused shared memory laid out as a shard's
                 data region (the only stall), written by
* ``persister``  a child process (or a thread) mapping that region.

Who uses them: the worker's side of a save is ``crucible.worker.checkpointing``
(the consistent cut, the named stateful parts, restore); the coordinator's is
``crucible.coordinator.checkpoints`` (naming the cut, collecting shards,
committing, retention).

The names below are loaded lazily, so ``crucible.checkpoint.policies`` can
be imported (by the coordinator or ``crucible interval``) without torch.
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
    "CheckpointCorrupt": "shard",
    "write_shard": "shard",
    "read_shard": "shard",
    "shard_name": "shard",
    "load_shard": "store",
    "read_manifest": "store",
    "commit": "store",
    "list_checkpoints": "store",
    "verify": "store",
    "latest_valid": "store",
    "clean_tmp": "store",
    "delete": "store",
    "set_metrics": "store",
    "seal": "store",
    "step_dir": "store",
    "tmp_dir": "store",
    "Region": "snapshot",
    "Snapshotter": "snapshot",
}


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{mod}", __name__), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))

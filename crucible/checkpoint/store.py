"""A job's checkpoint directories and the crash-safe commit protocol.

Layout of a job's checkpoint root::

    <ckpt_root>/
        step_00001200/              a committed checkpoint (has manifest.json)
            manifest.json
            r0s0.shard  r0s1.shard  r1s0.shard  ...   one per live worker
        .tmp-step_00001300/         a save in progress (never a checkpoint)
        .deleting-step_00000100-*/  a deletion in progress (never a checkpoint)

Only a ``step_<N>`` directory that contains ``manifest.json`` is a
checkpoint. The protocol that makes this true under crashes:

1. Each worker writes its shard into ``<root>/.tmp-step_<N>/`` (the bytes of
   a shard and how they are written: ``crucible.checkpoint.shard``); a
   shard file under its final name (``r{replica}s{stage}.shard``) is always
   complete. The worker reports ``{"name", "bytes", "checksum"}`` to the
   coordinator.
2. When every live worker has reported, the coordinator calls ``commit``:
   it checks that each reported file exists with the reported size, fsyncs
   every shard, writes ``manifest.json`` (fsynced) into the temporary
   directory, fsyncs that directory, renames it atomically to
   ``step_<N>``, and fsyncs ``<root>``. The rename is the commit point:
   before it there is no ``step_<N>``; after it there is a complete one.
3. At start, ``clean_tmp`` removes ``.tmp-*`` and ``.deleting-*`` leftovers
   (call it only when no save is in progress).
4. ``delete`` first renames ``step_<N>`` to ``.deleting-...`` (atomic; from
   then on it is not listed) and only then removes the files, so a crash
   mid-deletion never leaves a half-deleted checkpoint that looks committed.

The manifest (version 2) is ``{"format": "crucible-checkpoint", "version":
2, "step", "time", "checksum": "sha256", "shards": [{"name", "bytes",
"checksum"}, ...], "digest"}`` plus what the committer adds (Crucible:
``replicas``, ``topology``, ``vacant``, ``config_hash``, ``config``,
``metrics``, ...). ``digest`` is the SHA-256 of the rest of the manifest
(``seal``): a shard's checksum guards its bytes, the digest the manifest's,
so that a flipped bit or a hand edit that leaves valid JSON (a replica's
step, a shard dropped from the list, the configuration export builds the
model from) is a damaged checkpoint, not a quietly different one. Version 1
manifests (written before the digest) are read without that check.

Listing, verifying, committing and cleaning never import torch.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from crucible.metrics import whole

from .policies import CkptInfo
from .shard import CheckpointCorrupt, check_file, check_name, fsync_path, read_shard, shard_name, valid_name

__all__ = [
    "CheckpointCorrupt",
    "CkptInfo",
    "MANIFEST",
    "shard_name",
    "step_dir",
    "tmp_dir",
    "read_manifest",
    "load_shard",
    "commit",
    "set_metrics",
    "seal",
    "list_checkpoints",
    "verify",
    "latest_valid",
    "clean_tmp",
    "delete",
]

log = logging.getLogger(__name__)

FORMAT_VERSION = 2
LEGACY_VERSIONS = (1,)   # read, without a digest to check
MANIFEST = "manifest.json"
CHECKSUM_ALGORITHM = "sha256"

_STEP_RE = re.compile(r"^step_(\d+)$")
_TMP_PREFIX = ".tmp-step_"
_DELETING_PREFIX = ".deleting-"
_MANIFEST_RESERVED = ("format", "version", "step", "time", "checksum", "shards", "digest")


# --------------------------------------------------------------------------
# names and paths
# --------------------------------------------------------------------------


def step_dir(ckpt_root: str | os.PathLike, step: int) -> Path:
    """``<ckpt_root>/step_<NNNNNNNN>`` (the committed directory name)."""
    return Path(ckpt_root) / f"step_{_check_step(step):08d}"


def tmp_dir(ckpt_root: str | os.PathLike, step: int, create: bool = True) -> Path:
    """``<ckpt_root>/.tmp-step_<NNNNNNNN>``, the directory shards of a save in
    progress are written into; created (with parents) unless ``create`` is
    false. Several workers may call this for the same step."""
    p = Path(ckpt_root) / f"{_TMP_PREFIX}{_check_step(step):08d}"
    if create:
        p.mkdir(parents=True, exist_ok=True)
    return p


def _check_step(step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    return step


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temporary name, fsync, rename, fsync dir."""
    part = path.with_name(f".{path.name}.partial-{os.getpid()}")
    with open(part, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, path)
    fsync_path(path.parent, directory=True)


def _remove(entry: os.DirEntry) -> None:
    if entry.is_dir(follow_symlinks=False):
        shutil.rmtree(entry.path, ignore_errors=True)
    else:
        try:
            os.unlink(entry.path)
        except FileNotFoundError:
            pass


# --------------------------------------------------------------------------
# manifest
# --------------------------------------------------------------------------


def read_manifest(ckpt_path: str | os.PathLike) -> dict:
    """The parsed ``manifest.json`` of a checkpoint directory; raises
    ``CheckpointCorrupt`` when it is missing, unreadable or malformed."""
    p = Path(ckpt_path) / MANIFEST
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        raise CheckpointCorrupt(f"{p}: missing") from None
    except NotADirectoryError:
        raise CheckpointCorrupt(f"{ckpt_path}: not a directory") from None
    except OSError as e:
        raise CheckpointCorrupt(f"{p}: unreadable ({e})") from None
    try:
        m = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise CheckpointCorrupt(f"{p}: garbage ({e})") from None
    if not isinstance(m, dict) or m.get("format") != "crucible-checkpoint":
        raise CheckpointCorrupt(f"{p}: not a crucible checkpoint manifest")
    version = m.get("version")
    if isinstance(version, bool) or version not in (FORMAT_VERSION, *LEGACY_VERSIONS):
        raise CheckpointCorrupt(f"{p}: unsupported manifest version {version!r}")
    shards = m.get("shards")
    if not isinstance(m.get("step"), int) or not isinstance(shards, list):
        raise CheckpointCorrupt(f"{p}: lacks step/shards")
    for s in shards:
        if not (isinstance(s, dict) and valid_name(s.get("name")) and _count(s.get("bytes"))
                and isinstance(s.get("checksum"), str)):
            raise CheckpointCorrupt(f"{p}: malformed shard entry {str(s)[:100]!r}")
    why = _malformed_extra(m)
    if why:
        raise CheckpointCorrupt(f"{p}: malformed {why}")
    if version == FORMAT_VERSION and m.get("digest") != _digest(m):
        why = "does not match its digest (a flipped bit, or edited by hand)" if "digest" in m else "has no digest"
        raise CheckpointCorrupt(f"{p}: damaged: its content {why}")
    return m


def _digest(m: Mapping[str, Any]) -> str:
    """The SHA-256 of a manifest but its ``digest``, over its canonical JSON
    (sorted keys, no spaces): what it was written with and what it parses to
    give the same, whatever the layout of the file."""
    body = {k: v for k, v in m.items() if k != "digest"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode("utf-8")).hexdigest()


def seal(manifest: Mapping[str, Any]) -> dict:
    """``manifest`` as written: of this format version, with its ``digest``
    (computed on the JSON round trip of the rest: int keys become strings,
    tuples lists, as a reader sees them)."""
    m = json.loads(json.dumps({k: v for k, v in manifest.items() if k != "digest"}))
    m["version"] = FORMAT_VERSION
    m["digest"] = _digest(m)
    return m


def _count(x: Any, least: int = 0) -> bool:
    """An integer field of the manifest (``metrics.whole``: a bool is none) of at least ``least``."""
    return whole(x) and x >= least


def _malformed_extra(m: dict) -> str | None:
    """What is wrong with the committer's keys that a resume and the tools read
    (``replicas``, ``topology``, ``vacant``), where present; None when nothing."""
    replicas, topo, vacant = m.get("replicas"), m.get("topology"), m.get("vacant")
    if replicas is not None:
        if not isinstance(replicas, dict):
            return f"replicas {str(replicas)[:100]!r}"
        for k, v in replicas.items():
            if not (k.isascii() and k.isdigit() and isinstance(v, dict) and _count(v.get("step"))
                    and (v.get("round") is None or _count(v.get("round")))
                    and isinstance(v.get("state", ""), str)):
                return f"replica entry {k!r}: {str(v)[:100]!r}"
    if topo is not None and not (isinstance(topo, dict) and _count(topo.get("replicas"), 1)
                                 and _count(topo.get("stages"), 1)):
        return f"topology {str(topo)[:100]!r}"
    if vacant is not None and not (isinstance(vacant, list) and all(isinstance(v, str) for v in vacant)):
        return f"vacant {str(vacant)[:100]!r}"
    return None


def load_shard(ckpt_path: str | os.PathLike, name: str) -> dict:
    """Read shard ``name`` of a committed checkpoint, checked against the
    manifest's checksum."""
    m = read_manifest(ckpt_path)
    for s in m["shards"]:
        if s["name"] == name:
            return read_shard(Path(ckpt_path) / name, expected_checksum=s["checksum"])
    raise KeyError(f"{ckpt_path}: no shard {name!r} in the manifest")


def set_metrics(ckpt_path: str | os.PathLike, metrics: Mapping[str, float]) -> None:
    """Merge ``metrics`` (e.g. an eval loss computed after the save) into a
    committed checkpoint's manifest, atomically (temp file, fsync, rename)."""
    m = read_manifest(ckpt_path)
    merged = dict(m.get("metrics") or {})
    merged.update(metrics)
    m["metrics"] = merged
    _atomic_write_bytes(Path(ckpt_path) / MANIFEST, json.dumps(seal(m), indent=1).encode("utf-8"))


# --------------------------------------------------------------------------
# commit
# --------------------------------------------------------------------------


def commit(
    ckpt_root: str | os.PathLike,
    step: int,
    shards: Iterable[Mapping[str, Any]],
    manifest_extra: Mapping[str, Any] | None = None,
    *,
    verify_checksums: bool = False,
) -> CkptInfo:
    """Commit the save of ``step``: turn ``<root>/.tmp-step_<N>`` into
    ``<root>/step_<N>`` atomically (see the module docstring).

    ``shards`` are the workers' reports (``{"name", "bytes", "checksum"}``).
    Each must exist in the temporary directory with the reported size (and,
    with ``verify_checksums``, the reported checksum; that reads every byte),
    else ``CheckpointCorrupt`` is raised and nothing is committed. Files in
    the temporary directory that are not listed (a late or abandoned
    writer's) are removed before the rename. ``manifest_extra`` is merged
    into the manifest (JSON-serializable; must not use the reserved keys
    format/version/step/time/checksum/shards).

    Idempotent: committing a step that is already committed with the same
    shards (a coordinator redoing a commit after a restart) returns the
    existing checkpoint; a different set raises ``FileExistsError``.
    """
    root, step = Path(ckpt_root), _check_step(step)
    entries, extra = _commit_entries(step, shards, manifest_extra)
    tmp, final = tmp_dir(root, step, create=False), step_dir(root, step)
    if not tmp.exists() and (final / MANIFEST).exists():
        existing = read_manifest(final)
        if sorted(existing["shards"], key=lambda s: s["name"]) == entries:
            return _info_from(final, step)
        raise FileExistsError(f"{final} is already committed with different shards")
    if not tmp.is_dir():
        raise FileNotFoundError(f"{tmp}: no save in progress for step {step}")
    if final.exists():
        raise FileExistsError(f"{final} already exists")
    _check_reported(tmp, step, entries, verify_checksums)
    _keep_only(tmp, {e["name"] for e in entries})
    now = time.time()
    _write_manifest(tmp, {"format": "crucible-checkpoint", "version": FORMAT_VERSION, "step": step, "time": now,
                          "checksum": CHECKSUM_ALGORITHM, "shards": entries, **extra})
    os.rename(tmp, final)  # the commit point
    fsync_path(root, directory=True)
    return CkptInfo(step=step, time=now, path=str(final), metrics=_clean_metrics(extra.get("metrics")))


def _commit_entries(step: int, shards: Iterable[Mapping[str, Any]],
                    manifest_extra: Mapping[str, Any] | None) -> tuple[list[dict], dict]:
    """The manifest's shard entries (sorted by name) and extra keys, validated."""
    shards = [dict(s) for s in shards]
    extra = dict(manifest_extra or {})
    clash = [k for k in extra if k in _MANIFEST_RESERVED]
    if clash:
        raise ValueError(f"manifest_extra may not set reserved keys {clash}")
    names = [check_name(s.get("name")) for s in shards]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate shard names in commit of step {step}: {sorted(names)}")
    if not shards:
        raise ValueError(f"commit of step {step} lists no shards")
    entries = sorted(
        ({"name": s["name"], "bytes": int(s["bytes"]), "checksum": str(s["checksum"]).lower()} for s in shards),
        key=lambda s: s["name"],
    )
    return entries, extra


def _check_reported(tmp: Path, step: int, entries: list[dict], verify_checksums: bool) -> None:
    """Every reported shard is in ``tmp`` with its size (and checksum)."""
    for e in entries:
        p = tmp / e["name"]
        if verify_checksums:
            problems = check_file(p, e["bytes"], e["checksum"])
        else:
            try:
                size = p.stat().st_size
                problems = [] if size == e["bytes"] else [f"{e['name']}: size {size}, reported {e['bytes']}"]
            except FileNotFoundError:
                problems = [f"{e['name']}: shard file missing"]
        if problems:
            raise CheckpointCorrupt(f"cannot commit step {step}: " + "; ".join(problems))


def _keep_only(tmp: Path, names: set[str]) -> None:
    """Remove what a late or abandoned writer left in ``tmp``; fsync the shards kept."""
    for entry in os.scandir(tmp):
        if entry.name not in names:
            _remove(entry)
    for name in sorted(names):
        fsync_path(tmp / name)


def _write_manifest(tmp: Path, manifest: dict) -> None:
    data = json.dumps(seal(manifest), indent=1, sort_keys=False).encode("utf-8")
    with open(tmp / MANIFEST, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    fsync_path(tmp, directory=True)


# --------------------------------------------------------------------------
# listing, verification, cleanup
# --------------------------------------------------------------------------


def _clean_metrics(metrics: Any) -> dict:
    if not isinstance(metrics, dict):
        return {}
    return {
        str(k): float(v)
        for k, v in metrics.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool)
    }


def _info_from(path: Path, step: int) -> CkptInfo:
    try:
        m = read_manifest(path)
        t = m.get("time")
        t = float(t) if isinstance(t, (int, float)) and not isinstance(t, bool) else path.stat().st_mtime
        metrics = _clean_metrics(m.get("metrics"))
    except CheckpointCorrupt:
        # Still a (damaged) committed checkpoint: listed so that ``verify``
        # can report it and ``latest_valid`` skip it. (lstat: it may be a
        # symlink loop where the directory was.)
        t, metrics = path.lstat().st_mtime, {}
    return CkptInfo(step=step, time=t, path=str(path), metrics=metrics)


def gone(path: str | os.PathLike, doing: str) -> str | None:
    """The line for a checkpoint that its running job's preservation policy
    deleted while a command read it (``doing``: "read", "inspected"): its
    files then read as missing, which is no damage. None while it is there."""
    if os.path.lexists(path):
        return None
    return f"{path}: deleted by the job's preservation policy while being {doing}"


def list_checkpoints(ckpt_root: str | os.PathLike) -> list[CkptInfo]:
    """Committed checkpoints (every ``step_<N>``), sorted by step. Temporary
    and deleting directories are never listed. A checkpoint whose manifest is
    unreadable, or missing (the commit renames a directory that holds one:
    a ``step_<N>`` without it, or that is no directory, lost it since), is
    listed (time = its mtime, no metrics); ``verify`` reports what is wrong
    with it, and a resume falls back past it, saying so (skipped unlisted, it
    was passed over unannounced, and a new save of its step could not
    commit)."""
    out = []
    try:
        entries = list(os.scandir(Path(ckpt_root)))
    except FileNotFoundError:
        return []
    for entry in entries:
        m = _STEP_RE.match(entry.name)
        if not m:
            continue
        try:
            out.append(_info_from(Path(entry.path), int(m.group(1))))
        except FileNotFoundError:  # deleted while we looked
            continue
    out.sort(key=lambda c: c.step)
    return out


def shard_names(ckpt_path: str | os.PathLike) -> set[str]:
    """The names of the shards a committed checkpoint's manifest lists."""
    return {sh["name"] for sh in read_manifest(ckpt_path)["shards"]}


def verify(ckpt_path: str | os.PathLike, on_shard: Callable[[dict], None] | None = None) -> list[str]:
    """Problems with a committed checkpoint; empty when it is good.

    Checks that the manifest parses and names this step, and that every
    listed shard is present with the listed size and checksum (reads every
    byte). Extra files are not a problem. ``on_shard(entry)`` is called
    after each shard's check (progress).
    """
    path = Path(ckpt_path)
    try:
        m = read_manifest(path)
    except CheckpointCorrupt as e:
        return [str(e)]
    problems = []
    dm = _STEP_RE.match(path.name)
    if dm and int(dm.group(1)) != m["step"]:
        problems.append(f"{MANIFEST}: step {m['step']} but the directory is {path.name}")
    if not m["shards"]:
        problems.append(f"{MANIFEST}: lists no shards")
    for s in m["shards"]:
        problems.extend(check_file(path / s["name"], s["bytes"], s["checksum"]))
        if on_shard is not None:
            on_shard(s)
    return problems


def latest_valid(ckpt_root: str | os.PathLike, on_damaged=None) -> CkptInfo | None:
    """The newest committed checkpoint that passes ``verify``, falling back
    to older ones (each skipped one is logged with its problems, or given to
    ``on_damaged(info, problems)``); ``None`` when there is none."""
    for c in reversed(list_checkpoints(ckpt_root)):
        problems = verify(c.path)
        if not problems:
            return c
        if on_damaged is None:
            log.warning("checkpoint %s is damaged, falling back: %s", c.path, "; ".join(problems))
        else:
            on_damaged(c, problems)
    return None


def clean_tmp(ckpt_root: str | os.PathLike, keep_step: int | None = None) -> list[str]:
    """Remove leftovers of interrupted saves (``.tmp-step_*``) and deletions
    (``.deleting-*``), but the temporary directory of ``keep_step`` (a save in
    progress). Returns the names removed."""
    root = Path(ckpt_root)
    try:
        entries = list(os.scandir(root))
    except OSError:     # (none, or unreadable just now: chmod 000 under a running job; a later abort cleans)
        return []
    keep = None if keep_step is None else tmp_dir(root, keep_step, create=False).name
    removed = []
    for entry in entries:
        if entry.name.startswith((_TMP_PREFIX, _DELETING_PREFIX)) and entry.name != keep:
            _remove(entry)
            removed.append(entry.name)
    if removed:
        fsync_path(root, directory=True)
    return sorted(removed)


def set_aside(ckpt_path: str | os.PathLike, label: str) -> str:
    """Move a committed checkpoint out of the ``step_*`` namespace, keeping its
    files (e.g. for a post-mortem): ``<root>/<label>-step_<N>-<unix time>``.
    Returns the new path."""
    path = Path(ckpt_path)
    aside = path.with_name(f"{label}-{path.name}-{int(time.time())}")
    os.rename(path, aside)
    return str(aside)


_MODEL_SHAPE = ("n_layer", "d_model", "vocab_size", "subspace_rank")   # keys that shape the parameters


def resume_mismatch(manifest: Mapping[str, Any], cfg: Mapping[str, Any]) -> str | None:
    """Why a job of configuration ``cfg`` (``Config.to_dict()``) cannot resume
    from a checkpoint with ``manifest``: another topology, or another model
    (its shards would not load). None when it can."""
    topo = manifest.get("topology")
    topo = topo if isinstance(topo, Mapping) else {}
    r, s = topo.get("replicas"), topo.get("stages")
    if (r, s) != (cfg["job"]["replicas"], cfg["job"]["stages"]):
        return (f"it is of a {r}x{s} job and this one is {cfg['job']['replicas']}x{cfg['job']['stages']}: "
                f"resume with --replicas {r} --stages {s}, or use another run directory")
    stored = manifest.get("config")
    old = stored.get("model") if isinstance(stored, Mapping) else None
    if isinstance(old, Mapping):
        diff = [f"model.{k}={old[k]!r} (this job: {cfg['model'][k]!r})" for k in _MODEL_SHAPE
                if k in old and k in cfg["model"] and old[k] != cfg["model"][k]]
        if diff:
            return f"it was written with {', '.join(diff)}: its shards do not fit this model"
    return None


class CannotResume(RuntimeError):
    """``--resume`` asked for and no checkpoint of this run fits: the coordinator
    (and ``crucible check --resume``) stops with this line rather than train
    from step 0 or on shards that do not load."""


def resume_step(info: CkptInfo, manifest: Mapping[str, Any] | None = None) -> int:
    """The step a resume from checkpoint ``info`` starts at: its slowest
    replica's (the checkpoint's own step where its manifest does not say).
    ``manifest``: ``info``'s, where the caller has read it already."""
    try:
        replicas = (read_manifest(info.path) if manifest is None else manifest).get("replicas") or {}
        return min(int(r.get("step", info.step)) for r in replicas.values()) if replicas else info.step
    except (CheckpointCorrupt, OSError, AttributeError, TypeError, ValueError):
        return info.step


def nothing_left(info: CkptInfo, train_steps: int, manifest: Mapping[str, Any] | None = None) -> str | None:
    """Why a resume from ``info`` has nothing to train (every replica at or
    past train.steps: the job would start only to end), or None.
    ``manifest``: as for ``resume_step``."""
    if resume_step(info, manifest) < train_steps:
        return None
    return (f"--resume: the checkpoint to resume from is at step {info.step} and train.steps is {train_steps}: "
            f"nothing left to train; raise train.steps (--steps) above {info.step} to train on")


def stages_missing(ckpt_path: str | os.PathLike, replicas: int, stages: int) -> list[int]:
    """Stages with no shard in any replica in the checkpoint at ``ckpt_path``."""
    names = shard_names(ckpt_path)
    return [s for s in range(stages) if not any(shard_name(r, s) in names for r in range(replicas))]


def choose_resume(ckpt_root: str | os.PathLike, done: list[CkptInfo], cfg: Mapping[str, Any],
                  on_passed_over: Callable[[CkptInfo, list[str], list[int]], None] | None = None,
                  ) -> tuple[CkptInfo | None, dict[int, str]]:
    """What ``--resume`` continues from: the newest of ``done`` (the committed
    checkpoints under ``ckpt_root``, oldest first) that verifies and holds a
    shard of every stage, and why each newer one was passed over (step ->
    reason; ``on_passed_over(info, problems, stages_missing)`` is called for
    each). None when ``done`` is empty. CannotResume (its one line) when it
    is of another topology or model (``resume_mismatch`` with ``cfg``,
    ``Config.to_dict()``), or when none of ``done`` can be resumed from.
    Whether it has steps left to train is ``nothing_left``'s."""
    job = cfg["job"]
    unusable: dict[int, str] = {}
    for info in reversed(done):
        problems = verify(info.path)
        missing = [] if problems else stages_missing(info.path, job["replicas"], job["stages"])
        if problems or missing:
            # (every copy of the missing stages was lost before this save: resuming from it would
            # start them from scratch; an older checkpoint that has them wins)
            unusable[info.step] = "damaged: " + "; ".join(problems) if problems else \
                f"holds no shard of stage(s) {missing}"
            if on_passed_over is not None:
                on_passed_over(info, problems, missing)
            continue
        why = resume_mismatch(read_manifest(info.path), cfg)
        if why:
            raise CannotResume(f"--resume: checkpoint {info.path}: {why}")
        return info, unusable
    if done:
        # Starting from step 0 is not what --resume asked for: nothing is moved.
        step = max(unusable)
        raise CannotResume(f"--resume: none of the {len(done)} checkpoint(s) in {ckpt_root} can be resumed "
                           f"from (newest, step {step}: {unusable[step]}); nothing was moved: move them out of "
                           f"checkpoints/ to start from step 0")
    return None, unusable


def delete(ckpt_path: str | os.PathLike) -> None:
    """Delete a committed checkpoint crash-safely: rename it out of the
    ``step_*`` namespace first (atomic, fsynced), then remove its files."""
    path = Path(ckpt_path)
    if not _STEP_RE.match(path.name):
        raise ValueError(f"refusing to delete {path}: not a step_<N> checkpoint directory")
    doomed = path.with_name(f"{_DELETING_PREFIX}{path.name}-{os.getpid()}-{time.monotonic_ns()}")
    os.rename(path, doomed)
    fsync_path(path.parent, directory=True)
    shutil.rmtree(doomed, ignore_errors=True)

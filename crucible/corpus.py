"""A corpus's fingerprint, and what a difference of two means.

``crucible.data.Corpus.fingerprint()`` identifies the tokens a stage-0 worker
read, split as it splits them: ``{"path", "tokens", "train", "dtype",
"sha256"}``. A checkpoint's stage-0 shards record it (the data cursor), the
coordinator keeps the job's (``crucible.coordinator.membership``, "Corpus"),
and both refuse other data in the same words. Plain values only: this module
imports neither numpy nor torch (the coordinator never does).
"""

from __future__ import annotations

SAME_DATA = ("tokens", "train", "dtype", "sha256")     # what must match (the path may differ)
KEYS = ("path", *SAME_DATA)
KEEP = "(data.path, its contents, data.max_bytes, data.eval_fraction)"


def recorded(fp) -> bool:
    """``fp`` is a fingerprint that can be compared (an older Crucible's
    checkpoint, or a registration of a stage other than 0, has none)."""
    return isinstance(fp, dict) and isinstance(fp.get("sha256"), str) and bool(fp["sha256"])


def same(a: dict, b: dict) -> bool:
    """The same tokens, split the same way (``data.path`` itself may differ)."""
    return all(a.get(k) == b.get(k) for k in SAME_DATA)


def describe(fp: dict) -> str:
    """``data.path '/data/a.txt', 60,000 tokens (58,800 for training), sha256 64d79dc807ec``."""
    src = f"data.path {fp.get('path')!r}" if fp.get("path") else "the built-in corpus"
    n, t = fp.get("tokens"), fp.get("train")
    size = f"{n:,} tokens ({t:,} for training)" if isinstance(n, int) and isinstance(t, int) else "?"
    return f"{src}, {size}, sha256 {str(fp.get('sha256'))[:12]}"


def corpus_change(saved, now: dict, allow: bool = False) -> str | None:
    """Why a job reading the corpus ``now`` (``Corpus.fingerprint()``) cannot
    resume exactly from a checkpoint whose stage 0 read ``saved``: other
    tokens (another data.path, a file that changed, another data.max_bytes)
    or another split (data.eval_fraction). None when they are the same, when
    ``allow`` (data.allow_new_corpus), or when the checkpoint recorded none
    (an older Crucible)."""
    if allow or not recorded(saved) or same(saved, now):
        return None
    return (f"it was trained on other data ({describe(saved)}) than this job reads ({describe(now)}): exact resume "
            f"needs the same data {KEEP}; restore it, or set data.allow_new_corpus=true to train on from this "
            f"checkpoint on the new data")


def registration_change(slot: str, job, now, allow: bool = False) -> str | None:
    """Why the coordinator refuses the stage-0 worker of ``slot`` (``r1s0``),
    which read the corpus ``now``, in a job that trains on ``job`` (the first
    stage-0 registration's, or the resumed checkpoint's): replicas on
    different data are not the training asked for, nor can they resume
    exactly. None when they are the same, when ``allow``
    (data.allow_new_corpus), or when either is unknown."""
    if allow or not recorded(job) or not recorded(now) or same(job, now):
        return None
    return (f"{slot} read other data ({describe(now)}) than this job trains on ({describe(job)}): every replica's "
            f"stage 0 needs the same data {KEEP}; restore it on {slot}'s host, or set data.allow_new_corpus=true "
            f"to train on the new data")


def clean(fp) -> dict | None:
    """A recorded fingerprint's known keys (from a state file or a request), else None."""
    if not recorded(fp):
        return None
    return {k: fp.get(k) for k in KEYS}

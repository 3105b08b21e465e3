"""Byte-level token data.

Sources (``data.path``):

* ``""`` (default): the Python standard library's own ``.py`` sources on this
  machine (found with ``sysconfig``), in sorted path order, capped at
  ``data.max_bytes``: a corpus every machine with Python already has.
* a text file, or a folder of text files (read recursively, sorted): bytes.
* a ``.bin`` file of little-endian uint16 tokens (the nanoGPT convention).

Every source is read up to ``data.max_bytes`` bytes (a ``.bin``: that many
bytes' whole tokens). A FIFO, a device or a socket (as ``data.path`` or in
its folder) is refused: reading one blocks forever or never ends, and each
stage-0 worker reads the corpus again.

The last ``data.eval_fraction`` of the tokens is held out for evaluation. The
training part is cut into R contiguous shards, one per replica. A shard is cut
into windows of ``seq_len + 1`` tokens; each pass over the shard visits the
windows in a permutation drawn from (seed, replica, pass). The cursor (windows
consumed) is the reader's whole state, so the batch of step s is a pure
function of (seed, replica, s) and a resumed reader yields exactly what it
would have.
"""

from __future__ import annotations

import hashlib
import os
import stat
import sysconfig

import numpy as np
import torch


def _stdlib_files() -> list[str]:
    root = sysconfig.get_paths()["stdlib"]
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__"))
        out.extend(os.path.join(dirpath, f) for f in filenames if f.endswith(".py"))
    return sorted(out, key=lambda p: os.path.relpath(p, root))


def _not_regular(path: str) -> str | None:
    """What ``path`` is when it is neither a regular file nor a folder (a FIFO,
    a device, a socket: reading one blocks forever or never ends), else None."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None     # (said by whoever opens it)
    return _odd(mode)


def _odd(mode: int) -> str | None:
    """``_not_regular`` of a stat's mode."""
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return None
    return ("a FIFO" if stat.S_ISFIFO(mode) else "a character device" if stat.S_ISCHR(mode)
            else "a block device" if stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode) else "not a file")


def _text_files(folder: str) -> list[str]:
    def unreadable(e: OSError) -> None:
        # (os.walk skips a folder it cannot list: the corpus would silently lack it)
        raise ValueError(f"data.path: cannot read the folder {e.filename!r}: {e.strerror or e}")

    out = []
    for dirpath, dirnames, filenames in os.walk(folder, onerror=unreadable):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        out.extend(os.path.join(dirpath, f) for f in filenames if not f.startswith("."))
    for p in out:
        what = _not_regular(p)
        if what:
            raise ValueError(f"data.path: {p!r} in the folder is {what}, not a file of text")
    return sorted(out)


def _read_files(paths: list[str], max_bytes: int, skip_unreadable: bool = False) -> np.ndarray:
    parts, total = [], 0
    for p in paths:
        try:
            with open(p, "rb") as f:
                # In pieces: one read of max_bytes allocates all of it first (a data.max_bytes
                # of 1 TB, meant as "no cap", was a MemoryError).
                pieces, left = [], max(0, max_bytes - total)
                while left > 0 and (piece := f.read(min(left, 64 << 20))):
                    pieces.append(piece)
                    left -= len(piece)
                b = b"".join(pieces)
        except OSError as e:
            if skip_unreadable:
                continue
            raise ValueError(f"data.path: cannot read {p!r}: {e.strerror or e}") from None
        parts.append(b)
        total += len(b)
        if total >= max_bytes:
            break
    return np.frombuffer(b"".join(parts)[:max_bytes], dtype=np.uint8)


def _stat_problem(path: str) -> str | None:
    """Why ``path`` cannot be a corpus, or None: it cannot be looked at (not
    os.path.exists: it is False for a file in a folder this user may not
    enter, another user's home, which is no "no such file"), or it is
    neither a file nor a folder (``_not_regular``). One stat."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "no such file or folder"
    except OSError as e:
        return f"cannot read: {e.strerror or e}"
    what = _odd(mode)
    return f"{what}, not a file or a folder of files" if what else None


def load_tokens(path: str, max_bytes: int, vocab_size: int = 256) -> np.ndarray:
    """All tokens of the corpus, as uint8 (bytes) or uint16 (.bin). Raises
    ValueError naming ``data.path`` (and the file) for a source that does not
    exist, cannot be read, or holds token ids beyond ``model.vocab_size``.
    A leading ``~`` is this host's home (the shell leaves ``data.path=~/x`` as it is)."""
    path = os.path.expanduser(path)
    if not path:
        toks = _read_files(_stdlib_files(), max_bytes, skip_unreadable=True)
    elif problem := _stat_problem(path):
        raise ValueError(f"data.path {path!r}: {problem}")
    elif os.path.isdir(path):
        files = _text_files(path)
        if not files:
            raise ValueError(f"data.path {path!r}: the folder holds no files (empty corpus)")
        toks = _read_files(files, max_bytes)
    elif path.endswith(".bin"):
        try:
            size = os.path.getsize(path)
            # At most data.max_bytes of it (a whole number of tokens), as of a text file: a
            # .bin of many GB with a small cap was read whole (a MemoryError, or every
            # stage-0 worker holding all of it).
            raw = np.fromfile(path, dtype=np.uint8, count=min(size, max_bytes) // 2 * 2)
        except OSError as e:
            raise ValueError(f"data.path {path!r}: cannot read: {e.strerror or e}") from None
        if size % 2:
            raise ValueError(f"data.path {path!r}: a .bin file holds uint16 tokens, but its size "
                             f"({size} bytes) is odd")
        toks = raw.view("<u2")
        if toks.size and int(toks.max()) >= vocab_size:
            at = int(np.argmax(toks >= vocab_size))
            raise ValueError(f"data.path {path!r}: token id {int(toks[at])} (at token {at}) is beyond "
                             f"model.vocab_size {vocab_size}")
    else:
        toks = _read_files([path], max_bytes)
    if toks.dtype == np.uint8 and vocab_size < 256 and toks.size and int(toks.max()) >= vocab_size:
        raise ValueError(f"data.path {path!r}: byte tokens need model.vocab_size >= 256 (is {vocab_size})")
    return toks


def tokens_needed_for(cfg) -> int:
    """The fewest tokens a corpus needs: a held-out split of at least one
    sequence (and data.eval_fraction), and one training sequence per replica."""
    w, r = cfg.train.seq_len + 1, cfg.job.replicas
    return max((r + 1) * w, int(np.ceil(r * w / (1.0 - cfg.data.eval_fraction))) + 1)


class ShardReader:
    """Batches of one replica's shard; its state is the cursor."""

    def __init__(self, tokens: np.ndarray, replica: int, replicas: int, seq_len: int, seed: int):
        n = len(tokens)
        lo, hi = n * replica // replicas, n * (replica + 1) // replicas
        self.tokens = tokens[lo:hi]
        self.window = seq_len + 1
        self.n_windows = len(self.tokens) // self.window
        if self.n_windows < 1:
            raise ValueError(f"replica {replica}'s shard of the corpus has {len(self.tokens)} tokens, fewer than "
                             f"train.seq_len + 1 = {self.window}")
        self.replica, self.seed, self.seq_len = replica, seed, seq_len
        self.cursor = 0
        self._perm_pass, self._perm = -1, None

    def _window_index(self, i: int) -> int:
        p, j = divmod(i, self.n_windows)
        if p != self._perm_pass:
            rng = np.random.Generator(np.random.PCG64([self.seed, self.replica, p]))
            self._perm, self._perm_pass = rng.permutation(self.n_windows), p
        return int(self._perm[j])

    def batch_at(self, cursor: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = []
        for i in range(cursor, cursor + batch_size):
            w = self._window_index(i)
            rows.append(self.tokens[w * self.window:(w + 1) * self.window])
        arr = torch.from_numpy(np.stack(rows).astype(np.int64))
        return arr[:, :-1].contiguous(), arr[:, 1:].contiguous()

    def next_batch(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.batch_at(self.cursor, batch_size)
        self.cursor += batch_size
        return out

    def state_dict(self) -> dict:
        return {"cursor": self.cursor, "replica": self.replica, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if state.get("replica") != self.replica or state.get("seed") != self.seed:
            raise ValueError(f"data state is for replica {state.get('replica')} seed {state.get('seed')}, "
                             f"this reader is replica {self.replica} seed {self.seed}")
        self.cursor = int(state["cursor"])


def eval_batches(tokens: np.ndarray, seq_len: int, batch_size: int, n_batches: int):
    """Fixed held-out batches: evenly spaced windows of the evaluation split."""
    w = seq_len + 1
    n_windows = len(tokens) // w
    want = batch_size * n_batches
    if n_windows < 1:
        raise ValueError("held-out split is shorter than one sequence")
    idx = np.linspace(0, n_windows - 1, num=want).astype(np.int64)
    arr = torch.from_numpy(np.stack([tokens[i * w:(i + 1) * w] for i in idx]).astype(np.int64))
    x, y = arr[:, :-1].contiguous(), arr[:, 1:].contiguous()
    return [(x[i * batch_size:(i + 1) * batch_size], y[i * batch_size:(i + 1) * batch_size]) for i in range(n_batches)]


class Corpus:
    """The corpus split into training and held-out tokens."""

    def __init__(self, cfg):
        toks = load_tokens(cfg.data.path, cfg.data.max_bytes, cfg.model.vocab_size)
        where = f"data.path {cfg.data.path!r}" if cfg.data.path else "the built-in corpus"
        if len(toks) == 0:
            raise ValueError(f"{where}: empty corpus (0 tokens)")
        need = tokens_needed_for(cfg)
        if len(toks) < need:
            raise ValueError(f"{where}: {len(toks)} tokens, too few for train.seq_len {cfg.train.seq_len} with "
                             f"{cfg.job.replicas} replica(s) and data.eval_fraction {cfg.data.eval_fraction:g} "
                             f"(needs at least {need})")
        n_eval = max(int(len(toks) * cfg.data.eval_fraction), cfg.train.seq_len + 1)
        self.train, self.eval = toks[:-n_eval], toks[-n_eval:]
        self.path = cfg.data.path
        self._fingerprint: dict | None = None

    def fingerprint(self) -> dict:
        """What identifies the tokens this job reads, split as it splits them:
        ``{"path", "tokens", "train", "dtype", "sha256"}`` (SHA-256 of every
        token's bytes, training part first). Stage 0 records it in its shards
        (the data cursor); ``--resume`` compares it (``crucible.corpus``), and so
        does the coordinator at stage 0's registration."""
        if self._fingerprint is None:
            h = hashlib.sha256()
            for part in (self.train, self.eval):
                h.update(np.ascontiguousarray(part).data)
            self._fingerprint = {"path": self.path, "tokens": int(len(self.train) + len(self.eval)),
                                 "train": int(len(self.train)), "dtype": str(self.train.dtype),
                                 "sha256": h.hexdigest()}
        return self._fingerprint

    def held_out(self, split: str) -> np.ndarray:
        """The held-out tokens of ``train.eval_split``: all of them, or the first half
        (validation: tune on it) or the second (test: report on it), disjoint."""
        half = len(self.eval) // 2
        return {"all": self.eval, "validation": self.eval[:half], "test": self.eval[half:]}[split]

    def reader(self, cfg, replica: int) -> ShardReader:
        return ShardReader(self.train, replica, cfg.job.replicas, cfg.train.seq_len, cfg.train.seed)

"""What a job needs in memory, from its configuration alone: arithmetic, no
torch, nothing allocated.

Every entry point asks here before anything allocates parameters, so that a
typo such as ``model.n_layer=100000`` is one line within seconds instead of
a machine out of memory (or, under ``crucible launch``, workers killed by the
kernel and started again and again):

* ``Config.validate`` refuses a size that is absurd on any machine
  (``absurd``: more than ``MAX_PARAMS`` parameters, or byte counts past 64
  bits), naming the key;
* ``crucible check`` (``preflight.check_memory``) and ``crucible launch``'s
  pre-flight compare every worker the launch runs on this host, together,
  with the memory this host has available (and, on GPUs, each GPU's free
  memory);
* ``crucible worker`` compares its own stage, before building it, and exits
  2 with a line that leaves the amount available out (``check``'s
  `stable`), so that the launcher's crash-loop rule sees the same line twice
  and stops the job.

``crucible launch --no-check`` skips the pre-flight and sets ``SKIP_ENV``
for its workers; set by hand, it skips ``crucible check``'s comparison and a
worker's too.

The parameters are exact for the built-in model (``crucible/model.py``; the
tests compare them with ``sum(p.numel())`` of built stages). With
d = ``model.d_model``, V = ``model.vocab_size``, T = ``train.seq_len``
(the position table's length) and the blocks of each stage from
``split_layers``::

    each block       12 d^2 + 13 d   ln1 2d, attn.qkv 3d^2+3d, attn.proj d^2+d,
                                     ln2 2d, mlp.fc 4d^2+4d, mlp.proj 4d^2+d
    stage 0          + V d + T d     token and position embeddings
    the last stage   + 2 d + V d     final LayerNorm, head (no bias)

The memory a stage needs to train (``stage_need``) is an estimate, in bytes,
with P its parameters::

    weights          4 P   float32: the master weights under bf16 too
    gradients        4 P
    AdamW moments    8 P   exp_avg and exp_avg_sq
    outer state      4 P   θ_global; + 4 P for the error feedback (sparseloco)
                           or the Nesterov momentum (diloco) with job.replicas > 1
    outer round      4 P   Δ while a round is computed (job.replicas > 1, outer.mode not none)
    buffers                the subspace model's basis [d, r] and token shift [V, d], float32
    bf16 copies      2 P   per microbatch in flight (train.precision = bf16: autocast's
                           copies of the weights, kept for backward)
    activations            rough: k microbatches in flight x mb x T tokens x 64 d bytes
                           per block (36 d under bf16; with train.activation_checkpointing
                           4 d per block plus one block's whole set), and on the last
                           stage 12 V bytes a token (logits, log-softmax, their gradient);
                           mb = batch_size / microbatches, k = min(M, S - s) under 1F1B
                           (stage s of S), M under GPipe
    snapshot region  (4 + 8 + outer state) P   with checkpoint.enable_checkpointing: the
                           model, the optimizer and the outer state copied into host
                           memory (host memory on a GPU too)
    process          256 MiB a worker process (Python, torch, gRPC), plus the freed
                           frame buffers glibc keeps (``procs.keep_large_buffers``):
                           4 float32 boundary frames (mb x T x 4 d bytes), at most
                           256 MiB; on a GPU also a 512 MiB CUDA context on its device;
                           counted for the workers a launch will start, not for a
                           worker already running. (Measured on the CPU: 2 x 1
                           workers of 25.8M parameters each peaked at 1,688 MiB RSS,
                           about 440 MiB above the terms above, ~85 MiB of it shared
                           libraries; the README's 2 x 4 job of tiny stages took 2.26
                           GiB of MemAvailable with its coordinator and launcher, its
                           workers 309-403 MiB RSS each: 384 MiB flat a worker made
                           3.3 GiB of it.)

On a CPU everything is host memory. On a GPU the snapshot region and the
process are host memory; the rest is on the stage's GPU. A ``model.builder``
model is not estimated (its size is known only once built).
"""

from __future__ import annotations

import bisect
import copy
import os
from dataclasses import dataclass, field

from crucible.config import MODEL_PRESETS, Config, ConfigError

GiB = 1 << 30
MiB = 1 << 20
MAX_PARAMS = 10**13           # more than any machine trains; refused outright (Config.validate)
MAX_BYTES = 2**63             # a byte count past int64: refused outright too
PROCESS_BYTES = 256 * MiB     # a worker process beyond its stage's terms (module doc: measured)
KEPT_FRAMES = 4               # ... and the boundary frames' buffers glibc keeps for it,
KEPT_MAX = 256 * MiB          # at most this (procs.keep_large_buffers' limit)
CUDA_CONTEXT_BYTES = 512 * MiB

# The keys that set the size, in the order they are named when they tie.
SIZE_KEYS = ("model.n_layer", "model.d_model", "model.vocab_size", "train.seq_len", "train.batch_size",
             "train.microbatches", "model.subspace_rank", "job.replicas", "job.stages")

# Where each term lives on a GPU stage (the rest is on its device).
HOST_TERMS = ("snapshot region", "process")


class TooBig(ConfigError):
    """The job does not fit this host (or its GPU); the message is the one line to show
    (``have``: what the host or GPU has, in words)."""

    have = ""


def split_layers(n_layer: int, n_stages: int) -> list[range]:
    """Blocks of each stage: as even as possible, earlier stages take the extras (``stage_blocks``)."""
    out, start = [], 0
    for s in range(n_stages):
        n = stage_blocks(n_layer, n_stages, s)
        out.append(range(start, start + n))
        start += n
    return out


def block_params(d: int) -> int:
    return 12 * d * d + 13 * d


def stage_blocks(n_layer: int, n_stages: int, stage: int) -> int:
    """How many blocks stage `stage` holds (``split_layers``, without the list)."""
    base, extra = divmod(n_layer, n_stages)
    return base + (1 if stage < extra else 0)


def stage_params(cfg: Config, stage: int) -> int:
    """The parameters of stage `stage` of the built-in model (exact)."""
    m, S = cfg.model, cfg.job.stages
    d, V = m.d_model, m.vocab_size
    n = stage_blocks(m.n_layer, S, stage) * block_params(d)
    if stage == 0:
        n += V * d + cfg.train.seq_len * d
    if stage == S - 1:
        n += 2 * d + V * d
    return n


def total_params(cfg: Config) -> int:
    m = cfg.model
    d, V = m.d_model, m.vocab_size
    return m.n_layer * block_params(d) + V * d + cfg.train.seq_len * d + 2 * d + V * d


def stage_classes(cfg: Config) -> list[tuple[int, int]]:
    """(a stage, how many stages need what it needs): the stages of one
    replica in runs of stages that need the same (the same blocks, neither
    the first nor the last, the same microbatches in flight), each run named
    by its first stage, so that a job of many stages is summed in
    O(min(microbatches, stages)) steps. The runs are contiguous and in order."""
    S, M = cfg.job.stages, max(cfg.train.microbatches, 1)
    if S <= 3:
        return [(s, 1) for s in range(S)]
    # The middle stages 1..S-2: those below `full` have M microbatches in flight
    # (all of them under GPipe; under 1F1B those with S - s >= M); each from
    # `full` on has fewer, its own number: a run of one.
    full = S - 1 if cfg.train.schedule == "gpipe" else min(max(S - M + 1, 1), S - 1)
    out = {0: 1, S - 1: 1}
    for s in range(full, S - 1):
        out[s] = 1
    split = min(max(cfg.model.n_layer % S, 1), full)    # stages below n_layer % S hold one block more
    if split > 1:
        out[1] = split - 1
    if full > split:
        out[split] = full - split
    return sorted(out.items())


@dataclass
class StageNeed:
    """What one stage needs (bytes by term) and where: ``device`` is cpu or cuda:N."""
    stage: int
    params: int
    device: str = "cpu"
    terms: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.terms.values())

    @property
    def host(self) -> int:
        """Host memory: everything on a CPU; the snapshot region and the process on a GPU."""
        if not self.device.startswith("cuda"):
            return self.total
        return sum(v for k, v in self.terms.items() if k in HOST_TERMS)

    @property
    def on_device(self) -> int:
        """GPU memory (0 on a CPU)."""
        return self.total - self.host


def stage_need(cfg: Config, stage: int, device: str = "cpu", process: bool = False) -> StageNeed:
    """The memory stage `stage` needs to train, by term (module doc); `process`:
    count the worker process itself (one not started yet)."""
    m, t, S = cfg.model, cfg.train, cfg.job.stages
    P = stage_params(cfg, stage)
    d, V, T = m.d_model, m.vocab_size, t.seq_len
    M = max(t.microbatches, 1)
    mb = t.batch_size // M
    rounds = cfg.job.replicas > 1 and cfg.outer.mode != "none"
    outer = 4 * P + (4 * P if rounds else 0)
    inflight = M if t.schedule == "gpipe" else min(M, max(S - stage, 1))
    blocks = stage_blocks(m.n_layer, S, stage)
    bf16 = t.precision == "bf16"
    per_block = (36 if bf16 else 64) * d                   # bytes a token
    if t.activation_checkpointing:
        act = inflight * mb * T * 4 * d * blocks + mb * T * per_block * min(blocks, 1)
    else:
        act = inflight * mb * T * per_block * blocks
    if stage == S - 1:
        act += mb * T * 12 * V                             # (one microbatch's loss at a time)
    terms = {
        "weights": 4 * P,
        "gradients": 4 * P,
        "AdamW moments": 8 * P,
        "outer state": outer,
        "outer round": 4 * P if rounds else 0,
        "buffers": 4 * ((d * m.subspace_rank if m.subspace_rank else 0)
                        + (V * d if m.subspace_rank and m.subspace_token_shift > 0 else 0)),
        "bf16 copies": 2 * P * inflight if bf16 else 0,
        "activations (rough)": act,
        "snapshot region": (4 * P + 8 * P + outer) if cfg.checkpoint.enable_checkpointing else 0,
    }
    if process:
        terms["process"] = PROCESS_BYTES + min(KEPT_MAX, KEPT_FRAMES * mb * T * 4 * d)
        if device.startswith("cuda"):
            terms["CUDA context"] = CUDA_CONTEXT_BYTES
    return StageNeed(stage, P, device, terms)


# ---- naming the keys -----------------------------------------------------------


def _baseline(cfg: Config) -> dict:
    """What each size key would be "normally": the defaults, the preset's model keys under a preset."""
    base = Config()
    out = {k: base.get(k) for k in SIZE_KEYS}
    for k, v in MODEL_PRESETS.get(cfg.model.preset, {}).items():
        out[f"model.{k}"] = v
    return out


def _with(cfg: Config, key: str, value) -> Config:
    out = copy.copy(cfg)
    section, _, name = key.partition(".")
    setattr(out, section, copy.copy(getattr(cfg, section)))
    setattr(getattr(out, section), name, value)
    return out


def culprits(cfg: Config, measure, limit: int) -> list[str]:
    """The size keys to name for a `measure(cfg)` over `limit`: those whose
    value alone, set back to the default (the preset's), brings it within the
    limit; else those whose setting back saves the most (at least a tenth);
    largest saving first; failing those, model.preset (or the model's shape):
    the job as configured. Never empty."""
    now, base = measure(cfg), _baseline(cfg)
    saved = {}
    for key in SIZE_KEYS:
        if cfg.get(key) == base[key]:
            continue
        try:
            after = measure(_with(cfg, key, base[key]))
        except (ArithmeticError, ValueError):
            continue
        if after < now:
            saved[key] = (after <= limit, now - after)
    fit = [k for k, (ok, _) in saved.items() if ok]
    keys = fit or [k for k, (_, s) in saved.items() if s * 10 >= now]
    keys.sort(key=lambda k: -saved[k][1])
    return keys or (["model.preset"] if cfg.model.preset else ["model.n_layer", "model.d_model"])


def _named(cfg: Config, keys: list[str]) -> str:
    return ", ".join(f"{k}={cfg.get(k)}" for k in keys)


def _got(cfg: Config, keys: list[str]) -> str:
    """ConfigError's ending: " (got V)", and the other keys named."""
    also = f"; with {_named(cfg, keys[1:])}" if keys[1:] else ""
    return f" (got {cfg.get(keys[0])!r}{also})"


def size(n: int) -> str:
    return f"{n / GiB:,.1f} GiB" if n >= GiB // 10 else f"{n / MiB:,.0f} MiB"


# ---- the checks ---------------------------------------------------------------


def absurd(cfg: Config) -> str | None:
    """Why the built-in model's size is absurd on any machine (more than
    MAX_PARAMS parameters, or a stage's bytes past 64 bits), or None. The
    message names the key(s); Config.validate raises it as a ConfigError."""
    if cfg.model.builder:
        return None

    def worst(c: Config) -> int:
        return max(stage_need(c, s).total for s, _ in stage_classes(c))

    params = total_params(cfg)
    if params > MAX_PARAMS:
        keys = culprits(cfg, total_params, MAX_PARAMS)
        return (f"bad value for '{keys[0]}': the model would have {params:.3g} parameters, more than "
                f"10**13{_got(cfg, keys)}")
    need = worst(cfg)
    if need >= MAX_BYTES:
        keys = culprits(cfg, worst, MAX_BYTES - 1)
        return (f"bad value for '{keys[0]}': a stage would need {need:.3g} bytes of memory, past 64 "
                f"bits{_got(cfg, keys)}")
    return None


def host_available() -> tuple[int, str] | None:
    """Memory this host can still give (bytes) and where that was read: the
    kernel's MemAvailable, or a cgroup's limit less its use (less its
    reclaimable page cache) when that is lower. None where neither is known."""
    return _lowest(_meminfo("MemAvailable"), _cgroup_room())


def _meminfo(key: str) -> tuple[int, str] | None:
    """(bytes, key) of a /proc/meminfo line (kB there), or None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024, key
    except (OSError, ValueError, IndexError):
        pass
    return None


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
        return int(text)
    except (OSError, ValueError):
        return None


def _stat(path: str, key: str) -> int:
    try:
        with open(path) as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
    except (OSError, ValueError):
        pass
    return 0


def host_total() -> tuple[int, str] | None:
    """Memory this host has in all (bytes) and where that was read: the
    kernel's MemTotal, or a cgroup's limit when that is lower. What a worker
    compares its own stage with: what the others use now (and their
    allocators keep) is not its concern, only whether it could fit at all
    (the launch's pre-flight compares the whole job with what is available)."""
    return _lowest(_meminfo("MemTotal"), ((limit, where) for limit, _, where in _cgroup_limits()))


def _lowest(best: tuple[int, str] | None, others) -> tuple[int, str] | None:
    """The smallest of ``best`` and each (bytes, where) of ``others``."""
    for n, where in others:
        if best is None or n < best[0]:
            best = (n, where)
    return best


def _cgroup_room():
    """(limit - usage + inactive file pages, which) for each memory cgroup
    limit of this process that is set."""
    for limit, used, where in _cgroup_limits():
        yield max(limit - used, 0), where


def _cgroup_limits():
    """(limit, usage less inactive file pages, which) for each memory cgroup
    limit of this process that is set (v2: memory.max of its cgroup and its
    parents; v1: memory.limit_in_bytes)."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return
    for line in lines:
        _, controllers, path = line.split(":", 2) if line.count(":") >= 2 else ("", "", "")
        if controllers == "" and path:          # cgroup v2
            root = "/sys/fs/cgroup"
            parts = [p for p in path.split("/") if p]
            for i in range(len(parts), -1, -1):
                d = os.path.join(root, *parts[:i])
                limit = _read_int(os.path.join(d, "memory.max"))
                used = _read_int(os.path.join(d, "memory.current"))
                if limit is not None and used is not None and limit < 2**60:
                    yield limit, used - _stat(os.path.join(d, "memory.stat"), "inactive_file"), "cgroup memory.max"
        elif "memory" in controllers.split(","):  # cgroup v1
            for d in ("/sys/fs/cgroup/memory" + path, "/sys/fs/cgroup/memory"):
                limit = _read_int(os.path.join(d, "memory.limit_in_bytes"))
                used = _read_int(os.path.join(d, "memory.usage_in_bytes"))
                if limit is not None and used is not None and limit < 2**60:
                    yield (limit, used - _stat(os.path.join(d, "memory.stat"), "total_inactive_file"),
                           "cgroup memory.limit_in_bytes")
                    break


def workers_here(cfg: Config) -> str:
    """`who` for a launch's workers (``check``)."""
    R, S = cfg.job.replicas, cfg.job.stages
    return f"the job's {R * S:,} workers ({R:,} replica(s) x {S:,} stage(s), all on this host)"


ENUMERATE_SLOTS = 1 << 16      # up to this many workers, round-robin GPUs are counted slot by slot


def launch_slots(spec: str = "cpu", gpus: int = 0):
    """``check``'s `slots` for every worker of a launch on this host, on
    ``job.device`` `spec`: "cpu"; "cuda:N" (every stage on that GPU); "cuda"
    with `gpus` GPUs visible (slot r*S+s on GPU (r*S+s) mod gpus, as
    ``crucible.devices.resolve``); "cuda" with none visible here: labelled
    "cuda", only its host memory compared. A job of more than
    ENUMERATE_SLOTS workers on round-robin GPUs puts each stage class's
    share, rounded up, on every GPU (an over-estimate; its host check, a
    worker process each, refuses it first anyway)."""
    if spec != "cuda" or gpus < 1:
        return lambda c: [(s, spec, n * c.job.replicas) for s, n in stage_classes(c)]

    def slots(c: Config) -> list[tuple[int, str, int]]:
        R, S = c.job.replicas, c.job.stages
        classes = stage_classes(c)
        counts: dict[tuple[int, int], int] = {}
        if R * S <= ENUMERATE_SLOTS:
            firsts = [s for s, _ in classes]
            for s in range(S):
                first = firsts[bisect.bisect_right(firsts, s) - 1]
                for r in range(R):
                    key = (first, (r * S + s) % gpus)
                    counts[key] = counts.get(key, 0) + 1
        else:
            for first, n in classes:
                for g in range(gpus):
                    counts[(first, g)] = -(-n * R // gpus)
        return [(s, f"cuda:{g}", n) for (s, g), n in sorted(counts.items())]

    return slots


SKIP_ENV = "CRUCIBLE_NO_MEMORY_CHECK"   # set (to anything but "" or "0"): a worker does not compare its stage


def skipped() -> bool:
    """Whether this process was told not to compare its memory (``SKIP_ENV``:
    ``crucible launch --no-check`` sets it for its workers)."""
    return os.environ.get(SKIP_ENV, "") not in ("", "0")


def check(cfg: Config, slots, who: str, process: bool, device_free: dict[str, int] | None = None,
          host: tuple[int, str] | None | bool = True, hint: str = "", stable: bool = False,
          capacity: bool = False) -> str:
    """Refuse (TooBig, one line naming the keys that set the size) when the
    workers that would run here need more memory than this host has
    available, or than a GPU has free. ``slots(cfg)``: (stage, device, how
    many workers) of those workers, for the job's configuration or one with a
    size key set back (to name the keys: ``culprits``). ``device_free``:
    {"cuda:N": bytes free}, from the caller (this module never touches
    CUDA). `who` says whose need it is (``workers_here``, "stage 2 (r0s2)");
    `process`: count each worker's process (one not started yet). `host`:
    the host's (bytes, source); True: read it (``host_available``); None:
    unknown, not compared. `hint`: how to go on anyway, the line's end.
    `stable`: the line leaves out the memory available (which changes from
    one try to the next) so that the same refusal twice reads the same (the
    launcher's crash-loop rule compares the lines); TooBig's ``have`` holds
    it. `capacity`: `host` and `device_free` are what the host and each GPU
    have in all (``host_total``; a worker's own check), not what is free.
    Returns a summary line. A model.builder model is not estimated."""
    if cfg.model.builder:
        return "memory: not estimated (model.builder: its size is known once built)"

    def needs(c: Config) -> list[tuple[StageNeed, int]]:
        return [(stage_need(c, s, dev, process), n) for s, dev, n in slots(c)]

    mine = needs(cfg)
    if host is True:
        host = host_available()
    largest = max((need for need, _ in mine), key=lambda need: need.total)
    one = sum(n for _, n in mine) == 1
    what = (f"{largest.params:,} parameters" if one else
            f"the largest, stage {largest.stage}: ~{size(largest.total)} for {largest.params:,} parameters")
    checks = []
    has, free_ = ("in all", "in all") if capacity else ("available", "free")
    if host is not None:
        checks.append((lambda c: sum(need.host * n for need, n in needs(c)), host[0],
                       f"this host has {size(host[0])} {has} ({host[1]})",
                       f"more than this host has {has} ({host[1]})", "on this host"))
    for dev, free in sorted((device_free or {}).items()):
        checks.append((lambda c, dev=dev: sum(need.on_device * n for need, n in needs(c) if need.device == dev),
                       free, f"{dev} has {size(free)} {free_}", f"more than {dev} has {free_}", f"on {dev}"))
    for measure, limit, have, more, where in checks:
        need = measure(cfg)
        if need > limit:
            keys = culprits(cfg, measure, limit)
            err = TooBig(f"{_named(cfg, keys)}: {who} {'needs' if one else 'need'} ~{size(need)} {where} "
                         f"({what}; an estimate); {more if stable else have}{'; ' + hint if hint else ''}")
            err.have = have
            raise err
    total = sum(need.total * n for need, n in mine)
    room = f"; this host has {size(host[0])} {has} ({host[1]})" if host is not None else ""
    return f"memory: ~{size(total)} estimated for {who} ({what}){room}"

"""The job's configuration: one dataclass tree, loaded from TOML plus ``key=value``
overrides, validated once at start.

The coordinator is the single source of the configuration: it loads and
validates it, and hands it to every worker at registration as JSON
(``Config.to_dict`` / ``Config.from_dict``). This module never imports torch.

Errors name the bad key and, where one is close, the valid key that was
probably meant::

    ConfigError: unknown key 'train.setps' (did you mean 'train.steps'?)
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import re
import tomllib
from dataclasses import dataclass, field
from typing import Any

from crucible.compress.specs import parse_spec


PRECISIONS = ("fp32", "tf32", "bf16")
# model.preset -> (n_layer, n_head, d_model); parameters with the byte vocabulary
# and train.seq_len 512: small 1.7M, gpt-50m 57M, gpt-200m 202M.
MODEL_PRESETS = {
    "small": {"n_layer": 8, "n_head": 4, "d_model": 128},
    "gpt-50m": {"n_layer": 8, "n_head": 12, "d_model": 768},
    "gpt-200m": {"n_layer": 16, "n_head": 16, "d_model": 1024},
}
# train.seed's largest value (see _check_train; its message says 10**16).
SEED_MAX = 10**16


class ConfigError(ValueError):
    """A configuration key or value is invalid; the message names it."""


_HOST = r"[\w.-]+"                                        # a name or an IPv4 address
_V6 = r"[0-9A-Fa-f.]*:[0-9A-Fa-f.]*:[0-9A-Fa-f:.]*(?:%[\w.-]+)?"   # an IPv6 address ([v6] before a port)
_HOSTPORT = re.compile(rf"(?P<host>\[{_V6}\]|{_HOST})?:(?P<port>[0-9]+)")


def hostport_problem(value: str, dial: bool = False) -> str | None:
    """Why ``value`` is not ``host:port`` (``[v6]:port`` for an IPv6 address) with
    the port a number in 0..65535 (1..65535 for an address to `dial`), or None.
    An address to bind may leave the host out (``:7000``: the default host)."""
    m = _HOSTPORT.fullmatch(value)
    if not m or (dial and not m.group("host")):
        return "expected host:port, e.g. 127.0.0.1:7000, node1:7000 or [::1]:7000"
    port, low = int(m.group("port")), 1 if dial else 0
    if not low <= port <= 65535:
        return f"port {port} is out of range ({low}..65535)"
    return None


def is_host(value: str) -> bool:
    """A host name, an IPv4 address or an IPv6 one (bare or in brackets), without a port."""
    return re.fullmatch(rf"{_HOST}|{_V6}|\[{_V6}\]", value) is not None


def bind_problem(host: str, port: int = 0) -> str | None:
    """Why a server on this machine cannot bind ``host`` (a name that does not
    resolve, an address of another machine; with a ``port``, one taken), or
    None: a socket is bound to that port of each address it resolves to until
    one binds."""
    import socket

    name = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        infos = socket.getaddrinfo(name or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as e:
        return f"does not resolve ({getattr(e, 'strerror', None) or e})"
    why = "no address"
    for family, kind, proto, _, addr in infos:
        try:
            with socket.socket(family, kind, proto) as sock:
                if port:     # (as the servers bind: a port a closed connection left in TIME_WAIT is free)
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(addr)
            return None
        except OSError as e:
            why = e.strerror or str(e)
    return f"cannot be bound on this machine ({why})"


@dataclass
class JobConfig:
    replicas: int = 2          # data-parallel replicas (R)
    stages: int = 4            # pipeline stages per replica (S)
    # Where workers compute: "cpu", "cuda" (the visible GPUs round-robin over
    # the slots r*S+s: one stage per GPU when there are enough, several
    # otherwise) or "cuda:N" (every worker on GPU N). `worker --device`
    # overrides it for one worker.
    device: str = "cpu"
    # CUDA MPS for workers that share a GPU ("on": `crucible launch` runs an
    # MPS control daemon of its own for them; "off"). See crucible/mps.py.
    mps: str = "off"


@dataclass
class ModelConfig:
    # A named size ("small" = the defaults below, "gpt-50m", "gpt-200m"): it
    # sets n_layer, n_head and d_model; any of those given explicitly (file or
    # override, in any order) wins over the preset.
    preset: str = ""
    n_layer: int = 8           # transformer blocks in all, split over the stages
    n_head: int = 4
    d_model: int = 128
    vocab_size: int = 256      # byte-level tokens
    # A user model: "module:function" called as function(stage, n_stages, cfg)
    # returning the nn.Module of that stage (see README, "Bring your own model").
    builder: str = ""
    # Keep the residual stream in a fixed rank-r subspace (for the subspace
    # activation codec); 0 = off.
    subspace_rank: int = 0
    # With subspace_rank > 0: standard deviation of a fixed (untrained) token
    # embedding kept outside the subspace, which every stage rebuilds from the
    # token ids (the "token shift" of Protocol Models); 0 = everything in the
    # subspace, embeddings included.
    subspace_token_shift: float = 0.5


@dataclass
class DataConfig:
    # "" = the built-in corpus (this Python's standard library sources); else a
    # text file, a folder of text files, or a uint16 token .bin file.
    path: str = ""
    eval_fraction: float = 0.02   # tail of the corpus held out for evaluation
    max_bytes: int = 64 << 20     # cap on the bytes read from the corpus (a .bin: max_bytes // 2 tokens)
    # --resume on data other than the checkpoint was trained on (another file,
    # changed contents, max_bytes or eval_fraction) is refused unless this is set
    allow_new_corpus: bool = False


@dataclass
class TrainConfig:
    steps: int = 300
    batch_size: int = 16        # sequences per replica per step
    microbatches: int = 4       # M; batch_size must divide by it
    seq_len: int = 128
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0      # global norm across the stages; 0 = off
    eval_every: int = 50        # steps between held-out evaluations; 0 = off
    eval_batches: int = 2
    # which held-out windows: "all" of the held-out tail, or its first half
    # ("validation", for tuning) or second half ("test", for reporting)
    eval_split: str = "all"
    seed: int = 1337
    schedule: str = "1f1b"      # "1f1b" or "gpipe"
    # fp32 | tf32 (float32 matmuls on TF32 tensor cores; CUDA only, the same as
    # fp32 on a CPU) | bf16 (autocast to bfloat16, float32 master weights and
    # optimizer state). With bf16 the stage boundaries travel in bfloat16: half
    # the bytes before any codec.
    precision: str = "fp32"
    # Recompute each block's activations in backward instead of keeping them
    # (torch.utils.checkpoint): less memory per stage, about a third more compute.
    activation_checkpointing: bool = False


@dataclass
class OuterConfig:
    mode: str = "sparseloco"    # sparseloco | diloco | none
    H: int = 10                 # inner steps per outer round
    lr: float = 1.0             # outer learning rate alpha
    beta: float = 0.95          # error-feedback decay
    momentum: float = 0.9       # diloco Nesterov momentum
    chunk: int = 4096
    k: int = 64
    value_bits: int = 2
    clip: str = "median"        # median | none
    deadline_s: float = 30.0


@dataclass
class CompressConfig:
    forward: str = "none"       # none | bf16 | int8 | int4 | subspace
    backward: str = "none"


@dataclass
class CheckpointConfig:
    enable_checkpointing: bool = True
    async_checkpointing: bool = True
    enable_continuous_checkpointing: bool = True
    checkpoint_period: int = 100     # steps; ignored while continuous is on
    max_num_checkpoints_to_keep: int = 10
    minimum_interval_s: float = 30.0
    preserve: str = ""               # extra preservation policy spec
    persister: str = "process"       # process | thread: where a shard is written in the background
    preemption_timeout_s: float = 60.0   # on SIGTERM: longest wait for the final checkpoint


@dataclass
class FaultConfig:
    # The timeouts, shortest first (README, "Timeouts"); Config.validate refuses
    # a set that breaks this order:
    #   probe_timeout_s < heartbeat_timeout_s, 2 x heartbeat_interval_s <= heartbeat_timeout_s,
    #   net.keepalive_s < heartbeat_timeout_s <= rpc_timeout_s <= outer.deadline_s,
    #   suspicion_limit x rpc_timeout_s <= suspicion_window_s.
    heartbeat_interval_s: float = 0.5  # each worker (thread and pulse) beats this often
    heartbeat_timeout_s: float = 2.0   # silence that makes a worker dead (unless most are silent: README);
                                     # also how long a connection may leave a keepalive ping unanswered
    on_stage_failure: str = "skip"   # skip | wait | restart
    rpc_timeout_s: float = 10.0        # longest data-plane wait before stage 0 retries a step
    probe_timeout_s: float = 0.5       # a suspected worker must answer a probe within this
    suspicion_limit: int = 3         # contradicted suspicions of one boundary that evict one of its ends (0 = never)
    suspicion_window_s: float = 120.0  # ... within this many seconds


@dataclass
class NetConfig:
    # The interface `crucible launch` binds its coordinator and workers to; a
    # coordinator or worker started alone takes --bind instead.
    bind: str = "127.0.0.1"
    advertise: str = ""              # the coordinator's address as workers dial it ("" = the bound one)
    max_message_mb: int = 64         # largest gRPC message, control and data plane alike
    link_mbps: float = 0.0           # simulated link rate for the data plane; 0 = off
    # Boundary copies off the compute thread, on side CUDA streams
    # (crucible.worker.outbox): auto (on a GPU), on, off.
    overlap_copies: str = "auto"
    # Every gRPC connection pings its peer after this much silence; a peer that
    # leaves a ping unanswered for fault.heartbeat_timeout_s is gone (a silent
    # partition sends no RST: this is how a stream on it ends).
    keepalive_s: float = 1.0
    # Mutual TLS for every server and channel (README, "TLS"): a CA, this
    # host's certificate and key, or tls_dir holding ca.pem, <host>.pem,
    # <host>.key. A process reads them before it knows the job's
    # configuration, so workers take --tls-dir / $CRUCIBLE_TLS_DIR; these keys
    # are for `crucible launch` and the coordinator.
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    tls_dir: str = ""
    # The shared token is never configuration (it would be written into
    # metrics.jsonl and every manifest): it comes from $CRUCIBLE_TOKEN or
    # <run_dir>/token (0600), see crucible.rpc.


@dataclass
class MetricsConfig:
    # The coordinator also writes TensorBoard event files under run_dir/tensorboard
    # (needs the tensorboard package: pip install 'crucible[report]').
    tensorboard: bool = False
    # The coordinator serves Prometheus /metrics over HTTP on this port, on the
    # interface its gRPC server binds: -1 = off, 0 = any free port (written to
    # run_dir/prometheus.addr).
    prometheus_port: int = -1


@dataclass
class DebugConfig:
    dump_grads_step: int = -1        # write each stage's gradients at this step (tests)
    dump_outer: bool = False         # write each stage's global weights after every outer round
    stall_outer: str = ""            # "r1s1:30": that worker sleeps 30 s inside each outer round (fault tests)
    dump_final: bool = False         # write run_dir/debug/final_r{r}s{s}.pt (model, optimizer, outer state) at the end
    persist_delay_s: float = 0.0     # stretch every shard write by this much (checkpoint fault tests)
    commit_delay_s: float = 0.0      # the coordinator holds each commit this long, every shard in (fault tests)
    # On a GPU: deterministic kernels only (torch.use_deterministic_algorithms,
    # CUBLAS_WORKSPACE_CONFIG), for the bitwise GPU tests; slower. A CPU is deterministic already.
    deterministic: bool = False


@dataclass
class Config:
    job: JobConfig = field(default_factory=JobConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)
    compress: CompressConfig = field(default_factory=CompressConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    net: NetConfig = field(default_factory=NetConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)

    # ---- construction -------------------------------------------------

    @classmethod
    def load(cls, path: str | None = None, overrides: list[str] | dict | None = None) -> "Config":
        cfg = cls()
        if path:
            try:
                with open(path, "rb") as f:
                    tree = tomllib.load(f)
            except OSError as e:
                raise ConfigError(f"cannot read config file {path}: {e}") from None
            except tomllib.TOMLDecodeError as e:
                raise ConfigError(f"cannot read config file {path}: {e}{_toml_line(path, e)}") from None
            except UnicodeDecodeError as e:
                raise ConfigError(f"cannot read config file {path}: not UTF-8 text (byte {e.object[e.start]:#04x} "
                                  f"at offset {e.start}); TOML files are UTF-8") from None
            cfg.apply_tree(tree)
        if overrides:
            items = list(overrides.items() if isinstance(overrides, dict) else [_split_override(o) for o in overrides])
            given = [k for k, _ in items]
            if path:
                given += [f"model.{k}" for k in (tree.get("model") or {}) if isinstance(tree.get("model"), dict)]
            for key, value in items:
                cfg.set(key, value)
                if key == "model.preset":
                    cfg._apply_preset(keep=given)
        cfg.validate()
        return cfg

    def _apply_preset(self, keep: list[str] = ()) -> None:
        """Set what model.preset names, except the keys in `keep` (given explicitly)."""
        name = self.model.preset
        if not name:
            return
        if name not in MODEL_PRESETS:
            raise ConfigError(f"bad value for 'model.preset': must be one of {', '.join(MODEL_PRESETS)} "
                              f"(got {name!r})")
        for key, value in MODEL_PRESETS[name].items():
            if f"model.{key}" not in keep:
                setattr(self.model, key, value)

    @classmethod
    def from_dict(cls, tree: dict, validate: bool = True) -> "Config":
        """``validate=False`` for a configuration stored by a finished run (a
        checkpoint's, an export's): valid when it ran, whatever rules came since."""
        cfg = cls()
        cfg.apply_tree(tree)
        if validate:
            cfg.validate()
        return cfg

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    def digest(self) -> str:
        """A short hash of the configuration, recorded in checkpoint manifests."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]

    def apply_tree(self, tree: dict) -> None:
        if not isinstance(tree, dict):
            raise ConfigError("configuration must be a table of sections")
        for section, values in tree.items():
            if not isinstance(values, dict):
                raise ConfigError(f"'{section}' must be a section ([{section}]), got a value")
            for key, value in values.items():
                self.set(f"{section}.{key}", value)
        model = tree.get("model")
        if isinstance(model, dict) and model.get("preset"):
            self._apply_preset(keep=[f"model.{k}" for k in model if k != "preset"])

    def set(self, dotted: str, value: Any) -> None:
        section_name, _, key = dotted.partition(".")
        if not key:
            raise ConfigError(f"key '{dotted}' must look like section.key{_suggest(dotted, all_keys())}")
        section = getattr(self, section_name, None) if section_name in _sections() else None
        if section is None or key not in {f.name for f in dataclasses.fields(section)}:
            raise ConfigError(f"unknown key '{dotted}'{_suggest(dotted, all_keys())}")
        ftype = {f.name: f.type for f in dataclasses.fields(section)}[key]
        setattr(section, key, _coerce(dotted, ftype, value))

    # ---- validation -----------------------------------------------------

    def validate(self) -> None:
        """Every value on its own and against the others; ConfigError names the key."""
        for key in all_keys():
            # What numpy, torch and protobuf take: a larger int is an OverflowError deep inside them
            # (or in the checks below: fault.suspicion_limit x fault.rpc_timeout_s).
            value = self.get(key)
            self._need(not isinstance(value, int) or -2**63 <= value < 2**63, key,
                       "must fit in 64 bits (-2**63..2**63-1)")
        for check in (self._check_model, self._check_train, self._check_outer, self._check_checkpoint,
                      self._check_fault_and_net, self._check_size):
            check()

    def validate_here(self, coordinator: bool = False) -> None:
        """What only the machine that runs `crucible launch` can tell (not part
        of validate: a configuration is validated on every host of a job):
        net.bind is an address of this machine; with ``coordinator`` (it runs
        here: launch, not check), metrics.prometheus_port is free on it (a port
        in use stopped the coordinator after the start). ConfigError names the key."""
        problem = bind_problem(self.net.bind)
        self._need(problem is None, "net.bind", f"{problem}; it must be an address of this machine "
                                                "(e.g. 127.0.0.1, 0.0.0.0 or ::1)")
        if coordinator and self.metrics.prometheus_port > 0:
            problem = bind_problem(self.net.bind, self.metrics.prometheus_port)
            self._need(problem is None, "metrics.prometheus_port", f"{problem}; choose a free port, or 0 for any")

    def _need(self, ok: bool, key: str, msg: str) -> None:
        if not ok:
            raise ConfigError(f"bad value for '{key}': {msg} (got {self.get(key)!r})")

    def _check_model(self) -> None:
        need, m = self._need, self.model
        need(self.job.replicas >= 1, "job.replicas", "must be >= 1")
        need(_device_ok(self.job.device), "job.device", "must be cpu, cuda or cuda:N")
        need(self.job.mps in ("off", "on"), "job.mps", "must be off or on")
        need(self.job.mps == "off" or self.job.device.startswith("cuda"), "job.mps",
             f"on needs job.device cuda or cuda:N, not {self.job.device!r}")
        need(not m.preset or m.preset in MODEL_PRESETS, "model.preset", f"must be one of {', '.join(MODEL_PRESETS)}")
        need(self.job.stages >= 1, "job.stages", "must be >= 1")
        need(m.d_model >= 1, "model.d_model", "must be >= 1")
        need(m.n_head >= 1 and m.d_model % m.n_head == 0, "model.n_head", "must divide model.d_model")
        if not m.builder:
            need(m.n_layer >= self.job.stages, "model.n_layer",
                 f"needs at least one block per stage ({self.job.stages} stages)")
        need(1 <= m.vocab_size <= 65536, "model.vocab_size", "must be in 1..65536")
        need(0 <= m.subspace_rank <= m.d_model, "model.subspace_rank", "must be in 0..d_model")
        need(m.subspace_token_shift >= 0, "model.subspace_token_shift", "must be >= 0")
        need(0.0 < self.data.eval_fraction < 0.5, "data.eval_fraction", "must be in (0, 0.5)")
        need(self.data.max_bytes >= 1, "data.max_bytes", "must be >= 1 (bytes of text to read)")
        for key in ("compress.forward", "compress.backward"):
            # The workers' own parser (crucible.compress.specs, no torch): what
            # they would refuse after starting is refused here, naming the key.
            try:
                name, params = parse_spec(self.get(key))
            except ValueError as e:
                raise ConfigError(f"bad value for '{key}': {e} (got {self.get(key)!r})") from None
            need(name != "subspace" or m.subspace_rank > 0, key,
                 "the subspace codec needs model.subspace_rank > 0 (a model that keeps its residual "
                 "stream in the subspace)")
            need(params.get("rank", m.subspace_rank) == m.subspace_rank, key,
                 f"the subspace codec's rank must be model.subspace_rank ({m.subspace_rank}), the subspace "
                 "the model keeps its residual stream in; leave rank out to take it from there")

    def _check_train(self) -> None:
        need, t = self._need, self.train
        need(t.steps >= 1, "train.steps", "must be >= 1 (steps to train)")
        need(t.microbatches >= 1, "train.microbatches", "must be >= 1")
        need(t.batch_size >= 1 and t.batch_size % t.microbatches == 0,
             "train.batch_size", "must be a positive multiple of train.microbatches")
        need(t.seq_len >= 1, "train.seq_len", "must be >= 1")
        need(t.lr > 0, "train.lr", "must be > 0")
        need(0 <= t.min_lr <= t.lr, "train.min_lr", "must be in [0, train.lr]")
        need(t.warmup_steps >= 0, "train.warmup_steps", "must be >= 0")
        # What AdamW cannot take (torch's refuses it in the workers, after they start).
        need(0 <= t.beta1 < 1, "train.beta1", "must be in [0, 1)")
        need(0 <= t.beta2 < 1, "train.beta2", "must be in [0, 1)")
        need(t.weight_decay >= 0, "train.weight_decay", "must be >= 0")
        need(t.grad_clip >= 0, "train.grad_clip", "must be >= 0")
        need(t.eval_every >= 0, "train.eval_every", "must be >= 0")
        # Stage 0 builds the held-out batches at start even with eval_every = 0.
        need(t.eval_batches >= 1, "train.eval_batches", "must be >= 1")
        # numpy's data-order generator takes no negative seed; each worker seeds
        # torch with seed * 1000 + replica * 100 + stage, which must stay below 2**64.
        need(0 <= t.seed <= SEED_MAX, "train.seed", "must be in 0..10**16")
        need(t.eval_split in ("all", "validation", "test"), "train.eval_split", "must be all, validation or test")
        need(t.schedule in ("1f1b", "gpipe"), "train.schedule", "must be 1f1b or gpipe")
        need(t.precision in PRECISIONS, "train.precision", f"must be one of {', '.join(PRECISIONS)}")

    def _check_outer(self) -> None:
        need, o = self._need, self.outer
        need(o.mode in ("sparseloco", "diloco", "none"), "outer.mode", "must be sparseloco, diloco or none")
        need(o.H >= 1, "outer.H", "must be >= 1")
        need(o.lr > 0, "outer.lr", "must be > 0")
        # e <- beta * e + delta: 0 keeps no residual, 1 keeps all of it (plain error feedback).
        need(0 <= o.beta <= 1, "outer.beta", "must be in [0, 1]")
        need(0 <= o.momentum < 1, "outer.momentum", "must be in [0, 1)")
        need(1 <= o.chunk <= 4096, "outer.chunk", "must be in 1..4096 (12-bit indices)")
        need(1 <= o.k <= o.chunk, "outer.k", "must be in 1..outer.chunk")
        need(o.value_bits in (2, 8, 32), "outer.value_bits", "must be 2, 8 or 32")
        need(o.clip in ("median", "none"), "outer.clip", "must be median or none")
        need(o.deadline_s > 0, "outer.deadline_s", "must be > 0")

    def _check_checkpoint(self) -> None:
        need, c = self._need, self.checkpoint
        need(c.max_num_checkpoints_to_keep >= 1, "checkpoint.max_num_checkpoints_to_keep", "must be >= 1")
        need(c.minimum_interval_s >= 0, "checkpoint.minimum_interval_s", "must be >= 0")
        need(c.checkpoint_period >= 1, "checkpoint.checkpoint_period", "must be >= 1")
        need(c.persister in ("process", "thread"), "checkpoint.persister", "must be process or thread")
        need(c.preemption_timeout_s > 0, "checkpoint.preemption_timeout_s", "must be > 0")
        need(self.debug.persist_delay_s >= 0, "debug.persist_delay_s", "must be >= 0")
        need(self.debug.commit_delay_s >= 0, "debug.commit_delay_s", "must be >= 0")
        need(_stall_ok(self.debug.stall_outer), "debug.stall_outer", "must look like r1s1:30 (a worker, seconds >= 0)")
        if c.preserve:
            from crucible.checkpoint.policies import parse_preserve_spec

            try:
                parse_preserve_spec(c.preserve)
            except ValueError as e:
                raise ConfigError(f"bad value for 'checkpoint.preserve': {e}") from None

    def _check_fault_and_net(self) -> None:
        need, f = self._need, self.fault
        need(f.heartbeat_interval_s > 0, "fault.heartbeat_interval_s", "must be > 0")
        need(f.heartbeat_timeout_s > f.heartbeat_interval_s, "fault.heartbeat_timeout_s",
             "must exceed fault.heartbeat_interval_s")
        need(f.on_stage_failure in ("skip", "wait", "restart"), "fault.on_stage_failure",
             "must be skip, wait or restart")
        need(self.fault.rpc_timeout_s > 0, "fault.rpc_timeout_s", "must be > 0")
        need(self.fault.probe_timeout_s > 0, "fault.probe_timeout_s", "must be > 0")
        need(self.fault.suspicion_limit >= 0, "fault.suspicion_limit", "must be >= 0")
        need(self.fault.suspicion_window_s > 0, "fault.suspicion_window_s", "must be > 0")
        need(1 <= self.net.max_message_mb <= 1024, "net.max_message_mb", "must be in 1..1024")
        need(self.net.link_mbps >= 0, "net.link_mbps", "must be >= 0")
        need(self.net.overlap_copies in ("auto", "on", "off"), "net.overlap_copies", "must be auto, on or off")
        need(self.net.keepalive_s > 0, "net.keepalive_s", "must be > 0")
        need(is_host(self.net.bind), "net.bind",
             "must be a host name or address, without a port (e.g. 127.0.0.1, 0.0.0.0 or ::1)")
        adv = hostport_problem(self.net.advertise, dial=True) if self.net.advertise else None
        need(adv is None, "net.advertise", f"{adv}; or empty (the bound address)")
        need(-1 <= self.metrics.prometheus_port <= 65535, "metrics.prometheus_port",
             "must be -1 (off), 0 (any free port) or a port")
        tls = [k for k in ("net.tls_ca", "net.tls_cert", "net.tls_key") if self.get(k)]
        need(not tls or len(tls) == 3, tls[0] if tls else "net.tls_ca",
             "net.tls_ca, net.tls_cert and net.tls_key go together (or use net.tls_dir)")
        need(not (tls and self.net.tls_dir), "net.tls_dir", "give net.tls_dir or the three files, not both")
        self._check_timeouts()

    def _check_size(self) -> None:
        """A model absurd on any machine (over 10**13 parameters, or a stage's
        bytes past 64 bits: crucible.sizing.absurd), refused naming the key
        before anything tries to build it. Whether the job fits the machine it
        runs on is for the pre-flight and each worker (crucible.sizing.check)."""
        from crucible import sizing

        why = sizing.absurd(self)
        if why:
            raise ConfigError(why)

    def _check_timeouts(self) -> None:
        """The timeouts must nest (see FaultConfig): each check says why."""
        f = self.fault

        def order(ok: bool, key: str, why: str) -> None:
            if not ok:
                raise ConfigError(f"inconsistent timeouts: '{key}' = {self.get(key)!r}: {why}")

        order(2 * f.heartbeat_interval_s <= f.heartbeat_timeout_s, "fault.heartbeat_timeout_s",
              f"must be at least 2 x fault.heartbeat_interval_s ({f.heartbeat_interval_s}): one late heartbeat "
              "must not evict a worker")
        order(f.probe_timeout_s < f.heartbeat_timeout_s, "fault.probe_timeout_s",
              f"must be below fault.heartbeat_timeout_s ({f.heartbeat_timeout_s}): a probe confirms a failed "
              "stream faster than silence would")
        order(self.net.keepalive_s < f.heartbeat_timeout_s, "net.keepalive_s",
              f"must be below fault.heartbeat_timeout_s ({f.heartbeat_timeout_s}): a dead connection must be "
              "found within about the time a silent worker is")
        order(f.heartbeat_timeout_s <= f.rpc_timeout_s, "fault.rpc_timeout_s",
              f"must be at least fault.heartbeat_timeout_s ({f.heartbeat_timeout_s}): stage 0 must wait for a "
              "dead neighbour to be routed around before it gives up on a step")
        order(f.rpc_timeout_s <= self.outer.deadline_s, "outer.deadline_s",
              f"must be at least fault.rpc_timeout_s ({f.rpc_timeout_s}): a round waits for replicas that are "
              "retrying a step")
        order(f.suspicion_limit * f.rpc_timeout_s <= f.suspicion_window_s, "fault.suspicion_window_s",
              f"must be at least fault.suspicion_limit x fault.rpc_timeout_s ({f.suspicion_limit} x "
              f"{f.rpc_timeout_s}): each suspicion of a broken link takes up to one rpc_timeout")

    def get(self, dotted: str) -> Any:
        section, _, key = dotted.partition(".")
        return getattr(getattr(self, section), key)


def _device_ok(spec: str) -> bool:
    name, sep, index = spec.partition(":")
    return spec == "cpu" or (name == "cuda" and (not sep or (index.isascii() and index.isdigit())))


def _stall_ok(spec: str) -> bool:
    # crucible.worker.debug: the named worker sleeps float(seconds) in each outer round.
    if not spec:
        return True
    who, _, secs = spec.partition(":")
    try:
        return bool(who) and 0 <= float(secs or 0) < float("inf")
    except ValueError:
        return False


def _sections() -> list[str]:
    return [f.name for f in dataclasses.fields(Config)]


def all_keys() -> list[str]:
    cfg = Config()
    return [f"{s}.{f.name}" for s in _sections() for f in dataclasses.fields(getattr(cfg, s))]


def changes(saved: Any, now: dict) -> list[str]:
    """What differs between a checkpoint's configuration (``saved``, its
    manifest's ``config``: a ``to_dict()``) and this job's (``now``), one
    ``section.key old -> new`` each, in the configuration's order: what a resume with another
    configuration says, rather than two hashes. Empty when ``saved`` is not
    such a table (an older checkpoint). A key the checkpoint does not have
    (added since it was written) counts as its default: it is no change
    unless this job sets it otherwise."""
    if not isinstance(saved, dict):
        return []
    defaults, out = Config().to_dict(), []
    for key in all_keys():
        section, _, name = key.partition(".")
        was = saved.get(section)
        was = was if isinstance(was, dict) else {}
        old, new = was.get(name, defaults[section][name]), (now.get(section) or {}).get(name, "?")
        if old != new:
            out.append(f"{key} {json.dumps(old)} -> {json.dumps(new)}")
    return out


def _suggest(key: str, candidates: list[str]) -> str:
    # A right key in the wrong section first, then the closest spelling.
    tail = key.rpartition(".")[2]
    close = [c for c in candidates if c.rpartition(".")[2] == tail][:1]
    if not close:
        close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.5)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _split_override(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override '{text}' must look like section.key=value")
    return key.strip(), value.strip()


def _toml_line(path: str, e: Exception) -> str:
    """The line a TOML error is at, quoted: tomllib names its number only
    ("Cannot overwrite a value (at line 3, column 11)"), not the key."""
    m = re.search(r"at line (\d+), column", str(e))
    lineno = getattr(e, "lineno", None) or (int(m.group(1)) if m else None)   # (3.14's TOMLDecodeError has it)
    try:
        with open(path, "rb") as f:
            line = f.read().decode("utf-8", errors="replace").split("\n")[lineno - 1].strip()
    except (OSError, IndexError, TypeError):
        return ""
    return f": {line if len(line) <= 80 else line[:77] + '...'!r}" if line else ""


def _coerce(key: str, ftype: Any, value: Any) -> Any:
    tname = ftype if isinstance(ftype, str) else getattr(ftype, "__name__", str(ftype))
    try:
        if tname == "bool":
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on"):
                return True
            if isinstance(value, str) and value.lower() in ("false", "0", "no", "off"):
                return False
            raise ValueError
        if tname == "int":
            if isinstance(value, bool):
                raise ValueError
            if isinstance(value, float):
                if not value.is_integer():
                    raise ValueError
                return int(value)
            return int(value)
        if tname == "float":
            if isinstance(value, bool):
                raise ValueError
            out = float(value)
            if out != out or out in (float("inf"), float("-inf")):
                raise ValueError
            return out
        if tname == "str":
            if not isinstance(value, (str, int, float)) or isinstance(value, bool):
                raise ValueError
            return str(value)
    except (TypeError, ValueError):
        raise ConfigError(f"bad value for '{key}': expected {tname}, got {value!r}") from None
    raise ConfigError(f"'{key}' has an unsupported type {tname}")

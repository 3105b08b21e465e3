"""A network of hosts on one machine, for tests and benchmarks (Linux, root).

Each host is a network namespace of its own with one interface, ``eth0``, at
its own address in 198.18.0.0/15 (the range reserved for benchmarking,
RFC 2544): host 1 is 198.18.0.1, host 2 198.18.0.2, and so on. The other end
of each host's veth pair is a port (``h1``, ``h2``, ...) of a bridge ``br0``
that lives in a namespace of its own, so nothing is added to the root
namespace. Processes start inside a host with ``ip netns exec`` (``popen``),
in their own process group, and bind that host's address.

Faults, all silent (no RST, no ICMP from the network, just nothing):

* ``link_down(h)`` / ``link_up(h)``: the switch port of ``h`` goes down (its
  cable is pulled): ``h`` loses carrier, and whatever anyone sends to or from
  it is dropped.
* ``partition(h, peers)`` / ``heal(h, peers)``: packets between ``h`` and each
  of ``peers`` are dropped at the switch (both directions), while both go on
  reaching everyone else. The kernel here has no ``netem`` and no tc actions,
  so a drop is an ``htb`` class whose queue is ``pfifo limit 0``, selected by
  a ``u32`` filter on the source address.
* ``shape(h, mbit, peer=None)``: the rate of ``h``'s link (to and from
  ``peer`` only, when given) in both directions: ``htb`` classes on the
  switch port (traffic to ``h``) and on ``h``'s own ``eth0`` (traffic from it).

``close()`` kills every process started here (SIGKILL to each process group)
and deletes the namespaces (which deletes the veths and the bridge); it runs
from ``with`` and from the finalizers of tests, also when they fail. Names are
unique per topology (``cr<pid><n>``), and ``sweep()`` removes namespaces left
by processes that no longer exist (a test run that was SIGKILLed).
"""

from __future__ import annotations

import ipaddress
import itertools
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field

from crucible.procs import kill_group

SUBNET = ipaddress.ip_network("198.18.0.0/15")
PREFIX_RE = re.compile(r"^cr(\d+)n\d+(?:br|h\d+)$")
BIG_RATE = "10gbit"
_counter = itertools.count()
_available: tuple[bool, str] | None = None


class NetnsError(RuntimeError):
    """An ``ip`` or ``tc`` command failed; the message holds its stderr."""


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(list(argv), stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=30)
    if check and p.returncode != 0:
        raise NetnsError(f"{' '.join(argv)}: {p.stderr.strip() or p.stdout.strip()}")
    return p


def available() -> tuple[bool, str]:
    """Whether this machine can make namespaces: (ok, the reason when not)."""
    global _available
    if _available is not None:
        return _available
    if not os.path.exists("/proc/self/ns/net"):
        _available = (False, "no network namespaces (not Linux?)")
    elif os.geteuid() != 0:
        _available = (False, "network namespaces need root")
    elif shutil.which("ip") is None or shutil.which("tc") is None:
        _available = (False, "the 'ip' and 'tc' commands (iproute2) are not installed")
    else:
        name = f"cr{os.getpid()}n{next(_counter)}probe"
        try:
            _run("ip", "netns", "add", name)
            _run("ip", "netns", "del", name)
            _available = (True, "")
        except (NetnsError, OSError, subprocess.TimeoutExpired) as e:
            _available = (False, f"cannot create a network namespace: {e}")
    return _available


def sweep() -> list[str]:
    """Delete namespaces of this module whose creating process is gone."""
    removed = []
    p = _run("ip", "netns", "list", check=False)
    for line in p.stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        m = PREFIX_RE.match(name)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            _run("ip", "netns", "del", name, check=False)
            removed.append(name)
    return removed


@dataclass
class Host:
    name: str          # the test's name for it ("coord", "r0s1", ...)
    index: int         # 1, 2, ...: its port h<index> on the bridge
    ns: str            # its namespace
    ip: str            # its address

    @property
    def port(self) -> str:
        return f"h{self.index}"


@dataclass
class _Rule:
    peer_ip: str | None      # None: every packet
    kind: str                # "drop" | "rate"
    mbit: float = 0.0


@dataclass
class _Qdisc:
    """The rules of one interface (a switch port's egress, or a host's eth0)."""
    ns: str
    dev: str
    match: str               # "src" on switch ports (to the host), "dst" on eth0 (from it)
    rules: dict = field(default_factory=dict)   # key -> _Rule


class Topology:
    def __init__(self) -> None:
        ok, why = available()
        if not ok:
            raise NetnsError(why)
        sweep()
        self.prefix = f"cr{os.getpid()}n{next(_counter)}"
        self.bridge_ns = f"{self.prefix}br"
        self.hosts: dict[str, Host] = {}
        self.procs: list[subprocess.Popen] = []
        self._qdiscs: dict[tuple[str, str], _Qdisc] = {}
        self._closed = False
        _run("ip", "netns", "add", self.bridge_ns)
        try:
            _run("ip", "-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
            _run("ip", "-n", self.bridge_ns, "link", "set", "br0", "up")
        except NetnsError:
            self.close()
            raise

    # ---- hosts -------------------------------------------------------------

    def add_host(self, name: str) -> Host:
        if name in self.hosts:
            raise ValueError(f"host {name!r} exists")
        index = len(self.hosts) + 1
        ip = str(SUBNET.network_address + index)
        host = Host(name, index, f"{self.prefix}h{index}", ip)
        self.hosts[name] = host
        _run("ip", "netns", "add", host.ns)
        _run("ip", "-n", self.bridge_ns, "link", "add", host.port, "type", "veth", "peer", "name", "eth0",
             "netns", host.ns)
        _run("ip", "-n", self.bridge_ns, "link", "set", host.port, "master", "br0")
        _run("ip", "-n", self.bridge_ns, "link", "set", host.port, "up")
        _run("ip", "-n", host.ns, "addr", "add", f"{ip}/{SUBNET.prefixlen}", "dev", "eth0")
        _run("ip", "-n", host.ns, "link", "set", "eth0", "up")
        _run("ip", "-n", host.ns, "link", "set", "lo", "up")
        return host

    def host(self, name: str) -> Host:
        return self.hosts[name]

    def argv(self, name: str, argv: list[str]) -> list[str]:
        """`argv` to run inside host `name`."""
        return ["ip", "netns", "exec", self.hosts[name].ns, *argv]

    def popen(self, name: str, argv: list[str], **kw) -> subprocess.Popen:
        """Start `argv` inside host `name`, in its own process group; killed by close()."""
        kw.setdefault("stdin", subprocess.DEVNULL)
        proc = subprocess.Popen(self.argv(name, argv), start_new_session=True, **kw)
        self.procs.append(proc)
        return proc

    def kill(self, proc: subprocess.Popen) -> None:
        """SIGKILL a process started here, with its whole group."""
        kill_group(proc)

    # ---- faults ------------------------------------------------------------

    def link_down(self, name: str) -> None:
        _run("ip", "-n", self.bridge_ns, "link", "set", self.hosts[name].port, "down")

    def link_up(self, name: str) -> None:
        _run("ip", "-n", self.bridge_ns, "link", "set", self.hosts[name].port, "up")

    def partition(self, name: str, peers: list[str]) -> None:
        """Drop every packet between `name` and each of `peers`, both ways."""
        h = self.hosts[name]
        changes = []
        for p in peers:
            peer = self.hosts[p]
            changes.append((self.bridge_ns, h.port, "src", ("cut", peer.ip), _Rule(peer.ip, "drop")))
            changes.append((self.bridge_ns, peer.port, "src", ("cut", h.ip), _Rule(h.ip, "drop")))
        self._apply(changes)

    def heal(self, name: str, peers: list[str] | None = None) -> None:
        """Undo partition(name, peers) (every peer of `name` when None)."""
        h = self.hosts[name]
        peers = list(self.hosts) if peers is None else peers
        changes = []
        for p in peers:
            if p == name:
                continue
            peer = self.hosts[p]
            changes.append((self.bridge_ns, h.port, "src", ("cut", peer.ip), None))
            changes.append((self.bridge_ns, peer.port, "src", ("cut", h.ip), None))
        self._apply(changes)

    def shape(self, name: str, mbit: float | None, peer: str | None = None) -> None:
        """Hold `name`'s link (to and from `peer` only, when given) to `mbit`
        megabits per second in each direction; None removes the limit."""
        h = self.hosts[name]
        peer_ip = self.hosts[peer].ip if peer else None
        rule = _Rule(peer_ip, "rate", float(mbit)) if mbit else None
        self._set(self.bridge_ns, h.port, "src", ("rate", peer_ip), rule)
        self._set(h.ns, "eth0", "dst", ("rate", peer_ip), rule)
        if peer:
            p = self.hosts[peer]
            self._set(self.bridge_ns, p.port, "src", ("rate", h.ip), _Rule(h.ip, "rate", float(mbit)) if mbit else None)
            self._set(p.ns, "eth0", "dst", ("rate", h.ip), _Rule(h.ip, "rate", float(mbit)) if mbit else None)

    def _set(self, ns: str, dev: str, match: str, key, rule: _Rule | None) -> None:
        self._apply([(ns, dev, match, key, rule)])

    def _apply(self, changes: list) -> None:
        """Change rules, then render each interface that changed once."""
        touched = []
        for ns, dev, match, key, rule in changes:
            q = self._qdiscs.setdefault((ns, dev), _Qdisc(ns, dev, match))
            if rule is None:
                if key not in q.rules:
                    continue
                del q.rules[key]
            elif q.rules.get(key) == rule:
                continue
            else:
                q.rules[key] = rule
            if all(q is not t for t in touched):
                touched.append(q)
        for q in touched:
            self._render(q)

    def _render(self, q: _Qdisc) -> None:
        """Replace the interface's qdisc with one that implements its rules:
        drops first, then per-peer rates, then a rate for everything."""
        tc = ["ip", "netns", "exec", q.ns, "tc"]
        _run(*tc, "qdisc", "del", "dev", q.dev, "root", check=False)
        if not q.rules:
            return
        rules = sorted(q.rules.values(), key=lambda r: (r.kind != "drop", r.peer_ip is None))
        default = next((r for r in rules if r.peer_ip is None and r.kind == "rate"), None)
        _run(*tc, "qdisc", "add", "dev", q.dev, "root", "handle", "1:", "htb", "default", "1", "r2q", "1000")
        _run(*tc, "class", "add", "dev", q.dev, "parent", "1:", "classid", "1:1", "htb",
             *self._rate(default.mbit if default else None))
        _run(*tc, "qdisc", "add", "dev", q.dev, "parent", "1:1", "handle", "10:", *self._queue(q, default))
        for i, r in enumerate(r for r in rules if r.peer_ip is not None):
            cls = f"1:{0x20 + i:x}"
            handle = f"{0x20 + i:x}:"
            _run(*tc, "class", "add", "dev", q.dev, "parent", "1:", "classid", cls, "htb",
                 *self._rate(r.mbit if r.kind == "rate" else None))
            if r.kind == "drop":
                _run(*tc, "qdisc", "add", "dev", q.dev, "parent", cls, "handle", handle, "pfifo", "limit", "0")
            else:
                _run(*tc, "qdisc", "add", "dev", q.dev, "parent", cls, "handle", handle, *self._queue(q, r))
            _run(*tc, "filter", "add", "dev", q.dev, "parent", "1:", "protocol", "ip", "prio", str(1 + i), "u32",
                 "match", "ip", q.match, f"{r.peer_ip}/32", "flowid", cls)

    @staticmethod
    def _rate(mbit: float | None) -> list[str]:
        if not mbit:
            return ["rate", BIG_RATE, "quantum", "60000"]
        kbit = max(8, int(mbit * 1000))
        # A burst of about 10 ms of the rate (at least a few full-size packets).
        burst = max(6000, int(mbit * 1e6 / 8 * 0.01))
        return ["rate", f"{kbit}kbit", "ceil", f"{kbit}kbit", "burst", str(burst), "cburst", str(burst),
                "quantum", "1514"]

    @staticmethod
    def _queue(q: _Qdisc, rule: _Rule | None) -> list[str]:
        """A switch port buffers about 100 ms at its rate (at least 256 KiB: the
        kernel hands over segments of up to 64 KiB). A host's own interface
        never drops: the sender's TCP stack limits what it queues there (TCP
        small queues), as it does in front of a real NIC."""
        if q.match == "dst":
            return ["pfifo", "limit", "10000"]
        if rule is None or not rule.mbit:
            return ["bfifo", "limit", str(4 << 20)]
        return ["bfifo", "limit", str(max(256 << 10, int(rule.mbit * 1e6 / 8 * 0.1)))]

    # ---- the end -----------------------------------------------------------

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for proc in self.procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for h in self.hosts.values():
            self._delete_ns(h.ns)
        self._delete_ns(self.bridge_ns)

    @staticmethod
    def _delete_ns(ns: str) -> None:
        # A namespace that still has processes (a grandchild outside the
        # process group) is only unlinked here; the kernel frees it with them.
        for _ in range(3):
            if _run("ip", "netns", "del", ns, check=False).returncode == 0:
                return
            time.sleep(0.2)

    def __enter__(self) -> "Topology":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

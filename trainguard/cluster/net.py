"""Nodes on one machine: a network namespace per node, its own address on a private bridge and
its own host name; and the faults of a whole node — power-off, partition, a slow link.

Layout (``tag`` is this process's id plus a letter, so that leftovers can be told apart)::

    host:  bridge tgb<tag>  10.213.X.1/24   (the control plane listens here)
             ├─ veth tgv<tag>n0 ─── netns tgc-<tag>-node0: eth0 10.213.X.10/24, lo, host name node0
             ├─ veth tgv<tag>n1 ─── netns tgc-<tag>-node1: eth0 10.213.X.11/24, …
             └─ …

The bridge has no physical port, no namespace has a default route, and nothing here turns on
forwarding or NAT: a process in a node reaches only the bridge's subnet. ``X`` is the first
/24 of 10.213.0.0/16 that no interface of the host uses (searched from an offset of this process's
id, so that two harnesses starting at once pick different ones). Each node's host name lives in a UTS
namespace held by one ``sleep`` process (the node's "init"); ``popen`` runs a command in the
node's network and UTS namespaces (``nsenter``), with ``GLOO_SOCKET_IFNAME=eth0`` so gloo binds
the node's address (its host name resolves nowhere).

Faults (all take effect at once, seconds are Unix time in ``FaultRecord.ts_ns``):

* ``power_off(node)`` — the node's link goes down first (nothing it sends leaves: its peers'
  connections get no reset, as when a machine loses power), then every process in its network
  namespace is SIGKILLed (repeated until none is left). ``power_on`` brings it back empty.
* ``partition(node)`` / ``heal(node)`` — the host end of the node's veth down / up: the node's
  processes run on, unable to reach anything.
* ``slow_link(node, rate)`` / ``fast_link(node)`` — a ``tc`` token-bucket filter (``tbf``) on
  both ends of the veth: every byte to and from the node at ``rate`` (the kernel here has no
  ``netem``).

``stop()`` SIGKILLs every process of every node and deletes the namespaces, veths and the
bridge; ``cleanup_leftovers()`` (run by ``start``) does the same for those of processes that are
gone (a test killed mid-run). Raises ``NetUnavailable`` (with the reason) where the machine
cannot do this: no CAP_NET_ADMIN, no ``ip``/``nsenter``/``unshare``/``tc``.
"""
from __future__ import annotations

import ipaddress
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from typing import Sequence

__all__ = ["ClusterNet", "Node", "NetError", "NetUnavailable", "unavailable_reason",
           "cleanup_leftovers"]

NS_PREFIX = "tgc-"
_TOOLS = ("ip", "nsenter", "unshare", "tc")
_counter = 0


class NetError(RuntimeError):
    """A namespace, link or qdisc command failed (the command and its output)."""


class NetUnavailable(NetError):
    """This machine cannot build the cluster (the reason says what is missing)."""


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(argv, capture_output=True, text=True)
    if check and p.returncode != 0:
        raise NetError(f"{' '.join(argv)} exited {p.returncode}: {p.stderr.strip()[:300]}")
    return p


def unavailable_reason() -> str | None:
    """None when namespaces, veths and tc work here; else why not (for a test's skip)."""
    missing = [t for t in _TOOLS if shutil.which(t) is None]
    if missing:
        return f"missing {', '.join(missing)} (iproute2, util-linux)"
    try:
        with open("/proc/self/status") as fh:
            cap = int(re.search(r"CapEff:\s*([0-9a-f]+)", fh.read()).group(1), 16)
    except (OSError, AttributeError):
        cap = 0
    if not cap & (1 << 12):  # CAP_NET_ADMIN
        return "no CAP_NET_ADMIN (run as root, or in a container with --cap-add NET_ADMIN)"
    probe = f"{NS_PREFIX}probe{os.getpid()}"
    p = _run("ip", "netns", "add", probe, check=False)
    if p.returncode != 0:
        return f"`ip netns add` fails here: {p.stderr.strip()[:200]}"
    _run("ip", "netns", "del", probe, check=False)
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def ns_pids(ns: str) -> list[int]:
    """Pids of every process whose network namespace is ``ns`` (``/run/netns/<ns>``)."""
    try:
        ino = os.stat(f"/run/netns/{ns}").st_ino
    except OSError:
        return []
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            if os.stat(f"/proc/{d}/ns/net").st_ino == ino:
                out.append(int(d))
        except OSError:
            continue
    return out


def kill_ns(ns: str, timeout: float = 5.0) -> int:
    """SIGKILL every process in ``ns`` until none is left (a fork between two passes is caught by
    the next one). Returns how many were killed."""
    killed: set[int] = set()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = [p for p in ns_pids(ns) if p != os.getpid()]
        if not pids:
            return len(killed)
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
                killed.add(p)
            except ProcessLookupError:
                pass
        time.sleep(0.02)
    raise NetError(f"processes of {ns} survive SIGKILL: {ns_pids(ns)}")


def _tag_pid(tag: str) -> int | None:
    m = re.match(r"(\d+)", tag)
    return int(m.group(1)) if m else None


def cleanup_leftovers() -> list[str]:
    """Delete the namespaces, veths and bridges of harnesses whose process is gone (and SIGKILL
    what still runs in those namespaces). Returns what was removed."""
    removed = []
    p = _run("ip", "netns", "list", check=False)
    for line in p.stdout.splitlines():
        ns = line.split()[0] if line.split() else ""
        if not ns.startswith(NS_PREFIX):
            continue
        pid = _tag_pid(ns[len(NS_PREFIX):])
        if pid is not None and _alive(pid) and pid != os.getpid():
            continue
        if pid == os.getpid():
            continue  # ours: stopped by its ClusterNet
        kill_ns(ns)
        _run("ip", "netns", "del", ns, check=False)
        removed.append(ns)
    links = _run("ip", "-o", "link", "show", check=False).stdout
    for m in re.finditer(r"^\d+:\s+(tg[bv](\d+)[a-z][^:@\s]*)", links, re.M):
        name, pid = m.group(1), int(m.group(2))
        if not _alive(pid):
            _run("ip", "link", "del", name, check=False)
            removed.append(name)
    return removed


def _free_subnet() -> ipaddress.IPv4Network:
    used = _run("ip", "-o", "-4", "addr", "show", check=False).stdout
    nets = [ipaddress.ip_interface(m).network for m in re.findall(r"inet (\S+)", used)]
    for i in range(256):  # start at a place of our own: two harnesses starting at once differ
        x = (os.getpid() + _counter + i) % 256
        cand = ipaddress.ip_network(f"10.213.{x}.0/24")
        if not any(cand.overlaps(n) for n in nets):
            return cand
    raise NetError("no free /24 in 10.213.0.0/16 for the cluster bridge")


@dataclass
class Node:
    """One node: ``name`` (its host name), ``index``, ``ns`` (netns name), ``veth`` (the host
    end), ``addr`` (its address on the bridge), ``init`` (the process holding its UTS
    namespace; None while powered off), ``state``: ``up`` | ``partitioned`` | ``off``,
    ``slow``: the tc rate in force ('' for none)."""

    name: str
    index: int
    ns: str
    veth: str
    addr: str
    init: subprocess.Popen | None = None
    state: str = "up"
    slow: str = ""


@dataclass
class ClusterNet:
    """``n`` nodes named ``names`` (default ``node0`` …) on a private bridge (see the module
    docstring). ``start()`` builds it, ``stop()`` removes every trace; context manager."""

    n: int = 3
    names: Sequence[str] = ()
    nodes: list[Node] = field(default_factory=list)
    bridge: str = ""
    host_addr: str = ""
    subnet: str = ""
    tag: str = ""

    def __post_init__(self) -> None:
        global _counter
        self.names = list(self.names) or [f"node{i}" for i in range(self.n)]
        self.n = len(self.names)
        self.tag = f"{os.getpid()}{chr(ord('a') + _counter % 26)}"
        _counter += 1

    # ---- build / remove --------------------------------------------------------------------
    def start(self) -> "ClusterNet":
        why = unavailable_reason()
        if why:
            raise NetUnavailable(why)
        cleanup_leftovers()
        net = _free_subnet()
        hosts = list(net.hosts())
        self.subnet, self.host_addr = str(net), str(hosts[0])
        self.bridge = f"tgb{self.tag}"
        try:
            _run("ip", "link", "add", self.bridge, "type", "bridge")
            _run("ip", "addr", "add", f"{self.host_addr}/{net.prefixlen}", "dev", self.bridge)
            _run("ip", "link", "set", self.bridge, "up")
            for i, name in enumerate(self.names):
                node = Node(name, i, f"{NS_PREFIX}{self.tag}-{name}", f"tgv{self.tag}n{i}",
                            str(hosts[9 + i]))
                self.nodes.append(node)
                self._build(node)
        except BaseException:
            self.stop()
            raise
        return self

    def _build(self, node: Node) -> None:
        _run("ip", "netns", "add", node.ns)
        _run("ip", "link", "add", node.veth, "type", "veth", "peer", "name", "eth0", "netns",
             node.ns)
        _run("ip", "link", "set", node.veth, "master", self.bridge, "up")
        _run("ip", "-n", node.ns, "addr", "add", f"{node.addr}/24", "dev", "eth0")
        _run("ip", "-n", node.ns, "link", "set", "eth0", "up")
        _run("ip", "-n", node.ns, "link", "set", "lo", "up")
        node.init = subprocess.Popen(
            ["ip", "netns", "exec", node.ns, "unshare", "--uts", "sh", "-c",
             f"hostname {node.name} && exec sleep infinity"], stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 5
        while self.hostname(node) != node.name:
            if time.monotonic() > deadline or node.init.poll() is not None:
                raise NetError(f"node {node.name}: its UTS namespace did not come up")
            time.sleep(0.01)
        node.state, node.slow = "up", ""

    def stop(self) -> None:
        """SIGKILL every process of every node; delete namespaces, veths, bridge. Idempotent."""
        for node in self.nodes:
            try:
                kill_ns(node.ns)
            except NetError:
                pass
            if node.init is not None:
                node.init.poll()
            _run("ip", "netns", "del", node.ns, check=False)
            _run("ip", "link", "del", node.veth, check=False)
        if self.bridge:
            _run("ip", "link", "del", self.bridge, check=False)
        self.nodes = []

    def __enter__(self) -> "ClusterNet":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- running things on a node ---------------------------------------------------------
    def node(self, name: str | int) -> Node:
        """The node called ``name`` (or at that index). Raises KeyError."""
        for n in self.nodes:
            if n.name == name or n.index == name:
                return n
        raise KeyError(f"no node {name!r}: nodes are {', '.join(n.name for n in self.nodes)}")

    def hostname(self, node: Node) -> str:
        if node.init is None or node.init.poll() is not None:
            return ""
        p = _run("nsenter", f"--uts=/proc/{node.init.pid}/ns/uts", "hostname", check=False)
        return p.stdout.strip()

    def argv(self, node: str | Node, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside ``node``'s network and UTS namespaces."""
        n = node if isinstance(node, Node) else self.node(node)
        if n.init is None or n.init.poll() is not None:
            raise NetError(f"node {n.name} is powered off")
        return ["nsenter", f"--net=/run/netns/{n.ns}", f"--uts=/proc/{n.init.pid}/ns/uts",
                "--", *argv]

    def env(self, node: str | Node, base: dict[str, str] | None = None) -> dict[str, str]:
        """The environment of a process on ``node``: ``base`` (default ours) plus the node's
        name and the interface gloo must use."""
        n = node if isinstance(node, Node) else self.node(node)
        return {**(os.environ if base is None else base), "GLOO_SOCKET_IFNAME": "eth0",
                "TP_SOCKET_IFNAME": "eth0", "TG_NODE": n.name}

    def popen(self, node: str | Node, argv: Sequence[str], env: dict[str, str] | None = None,
              **kw) -> subprocess.Popen:
        """Start ``argv`` on ``node`` (``subprocess.Popen`` keywords pass through)."""
        return subprocess.Popen(self.argv(node, argv), env=self.env(node, env), **kw)

    def pids(self, node: str | Node) -> list[int]:
        """Every process of ``node`` (its init included)."""
        n = node if isinstance(node, Node) else self.node(node)
        return ns_pids(n.ns)

    # ---- faults --------------------------------------------------------------------------
    def power_off(self, node: str | Node) -> int:
        """Link down, then every process of the node SIGKILLed. Returns Unix ns of the fault."""
        n = node if isinstance(node, Node) else self.node(node)
        ts = time.time_ns()
        _run("ip", "link", "set", n.veth, "down")
        kill_ns(n.ns)
        if n.init is not None:
            n.init.wait()
        n.init, n.state = None, "off"
        return ts

    def power_on(self, node: str | Node) -> None:
        """An empty node again (new namespace, same name and address)."""
        n = node if isinstance(node, Node) else self.node(node)
        kill_ns(n.ns)
        _run("ip", "netns", "del", n.ns, check=False)
        _run("ip", "link", "del", n.veth, check=False)
        self._build(n)
        # same address, new link: what the others remember of the old one would take their
        # packets to it until the entry ages out (a srun task launch to a node powered on
        # again failed that way)
        _run("ip", "neigh", "flush", "to", n.addr, check=False)
        for other in self.nodes:
            if other is not n and other.state != "off":
                _run("ip", "-n", other.ns, "neigh", "flush", "to", n.addr, check=False)

    def partition(self, node: str | Node) -> int:
        """Cut the node off (host end of its veth down). Returns Unix ns of the fault."""
        n = node if isinstance(node, Node) else self.node(node)
        ts = time.time_ns()
        _run("ip", "link", "set", n.veth, "down")
        n.state = "partitioned"
        return ts

    def heal(self, node: str | Node) -> int:
        n = node if isinstance(node, Node) else self.node(node)
        ts = time.time_ns()
        _run("ip", "link", "set", n.veth, "master", self.bridge, "up")
        n.state = "up" if n.init is not None else "off"
        return ts

    def slow_link(self, node: str | Node, rate: str = "1mbit") -> int:
        """Rate-limit the node's traffic both ways (tc tbf, burst 32 kbit, queue ≤ 400 ms)."""
        n = node if isinstance(node, Node) else self.node(node)
        ts = time.time_ns()
        tbf = ["root", "tbf", "rate", rate, "burst", "32kbit", "latency", "400ms"]
        _run("tc", "qdisc", "replace", "dev", n.veth, *tbf)
        _run("ip", "netns", "exec", n.ns, "tc", "qdisc", "replace", "dev", "eth0", *tbf)
        n.slow = rate
        return ts

    def fast_link(self, node: str | Node) -> int:
        n = node if isinstance(node, Node) else self.node(node)
        ts = time.time_ns()
        _run("tc", "qdisc", "del", "dev", n.veth, "root", check=False)
        _run("ip", "netns", "exec", n.ns, "tc", "qdisc", "del", "dev", "eth0", "root",
             check=False)
        n.slow = ""
        return ts

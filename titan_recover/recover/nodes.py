"""A replica-group job on many nodes: which groups each node runs, and what the nodes' launchers agree on (pure).

One launcher per node (docs/deploy.md "Running on many nodes"). Each replica group lives on one node; node ``i``
of ``N`` runs a contiguous block of the job's groups (active ones and spares), the first ``groups % N`` nodes one
more (:func:`node_groups`). Node 0 publishes its resolved config in the job's store and every other node compares
its own before starting anything (:func:`first_difference` names the first line that differs). Each node other
than 0 acknowledges the job's verdict, so that node 0, whose launcher hosts the embedded store, keeps it up until
everyone has read it (:class:`NodeKeys`).
"""

from __future__ import annotations

import ipaddress
import os
import socket
from dataclasses import dataclass


class NodeKeys:
    """Store keys the nodes' launchers share (the protocols' own are ``GroupKeys``, ``DilocoKeys``)."""

    CONFIG = "nodes/config"
    """Node 0's resolved config, as ``--print-config`` renders it."""
    START = "nodes/start"
    """Node 0's start time (``time.time()``): time-triggered chaos faults count from it on every node."""

    @staticmethod
    def launcher(node: int) -> str:
        """etcd: held (a lease-bound key) by the launcher running node ``node`` of the job, naming its host and
        process: a second launcher for the same node is refused while it lives; a replacement takes it once the
        lost one's lease lapsed."""
        return f"nodes/launcher/{node}"

    @staticmethod
    def ack(node: int) -> str:
        """Written by node ``node``'s launcher once it read the job's verdict: its exit code."""
        return f"nodes/ack/{node}"


@dataclass(frozen=True)
class NodePlan:
    """This node's part of the job: ``rank`` of ``nnodes``, its replica groups, and where the embedded store is
    (``endpoint``, ``(host, port)``: node 0 hosts it there, the others connect; None: one node, at
    ``127.0.0.1:coordinator_port``)."""

    nnodes: int
    rank: int
    groups: range
    endpoint: tuple[str, int] | None = None

    @property
    def many(self) -> bool:
        return self.nnodes > 1

    def describe(self) -> str:
        groups = (f"replica group {self.groups.start}" if len(self.groups) == 1 else
                  f"replica groups {self.groups.start}-{self.groups.stop - 1}")
        return f"node {self.rank} of {self.nnodes}: {groups}"


def single_node(groups: int) -> NodePlan:
    return NodePlan(1, 0, range(groups))


def node_groups(groups: int, nnodes: int, rank: int) -> range:
    """The replica groups node ``rank`` of ``nnodes`` runs: a contiguous block, ``groups // nnodes`` of them, one
    more on the first ``groups % nnodes`` nodes. ValueError, with the arithmetic, for more nodes than groups (a
    group lives on one node: a node would have none)."""
    if not 0 <= rank < nnodes:
        raise ValueError(f"--node-rank {rank} is not a rank of --nnodes {nnodes} (0 ... {nnodes - 1})")
    if nnodes > groups:
        raise ValueError(f"--nnodes {nnodes} is more than the job's {groups} replica groups (recover.replicas + "
                         f"recover.spares): each replica group runs on one node, so {nnodes - groups} node(s) would "
                         f"have nothing to run; use at most {groups} nodes, or more replica groups")
    base, extra = divmod(groups, nnodes)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))


def groups_outside(nodes: set[int], groups: int, nnodes: int) -> int:
    """How many of the job's replica groups run on nodes not in ``nodes``."""
    return sum(len(node_groups(groups, nnodes, rank)) for rank in range(nnodes) if rank not in nodes)


def parse_endpoint(text: str) -> tuple[str, int]:
    """``HOST:PORT`` of ``--rdzv-endpoint`` (IPv6 in brackets); ValueError saying what is wrong."""
    host, sep, port = text.strip().rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"--rdzv-endpoint must be HOST:PORT with a port in 1 ... 65535 (node 0's address, where "
                         f"its launcher hosts the job's store), got {text!r}")
    return host, int(port)


def address_towards(host: str, port: int) -> str:
    """This machine's address on its route to ``host:port``, as the machines there reach it back (no packet is
    sent: connecting a UDP socket only chooses the route). Where a node's processes serve the job's other nodes
    (a standby syncer that leads, with an etcd store) and nothing else names the node's address."""
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(address)
        return probe.getsockname()[0]


NODE_ADDRESS_ENV = "TITAN_RECOVER_NODE_ADDRESS"
"""This node's address as the job's other nodes reach it, where a server of this node is advertised to them (its
snapshot keeper in a job without replica groups, a standby syncer on an etcd store). Unset: found as
:func:`node_address` says."""


def node_address(found, environ=os.environ) -> str:
    """``TITAN_RECOVER_NODE_ADDRESS`` if set, else ``found()`` (the node's fully qualified name, as torchrun names a
    node to the others, or the address on the route to a store); the caller warns about a loopback one
    (:func:`unreachable`)."""
    return environ.get(NODE_ADDRESS_ENV) or found()


def is_loopback(host: str) -> bool:
    """Whether ``host`` resolves only to loopback addresses (a hostname mapped to Debian's 127.0.1.1 included):
    no other machine reaches it there. False where it does not resolve here."""
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


def unreachable(what: str, host: str) -> str | None:
    """The warning for a server of this node advertised to other nodes at a loopback ``host``, or None. A warning,
    not an error: several "nodes" on one machine (tests) reach each other there."""
    if not is_loopback(host):
        return None
    return (f"{what} is advertised to the other nodes as {host!r}, which resolves to a loopback address here: "
            f"other machines cannot reach it. Set {NODE_ADDRESS_ENV} to this node's address on the network the "
            "nodes share (or fix the hostname's entry in /etc/hosts)")


def agreed_text(config_text: str, ranks_per_replica: int) -> str:
    """What every node must agree on before anything starts: the resolved config, and the processes of each
    replica group (``--nproc-per-node`` or the node's GPUs, which the config does not hold): groups of different
    sizes on two nodes could never reduce together."""
    return f"# processes per replica group = {ranks_per_replica}\n{config_text}"


def first_difference(reference: str, ours: str) -> str | None:
    """Where config text ``ours`` first differs from ``reference`` (both as ``--print-config`` renders them), as
    ``[section] key: node 0 has ..., this node has ...``; None if they are the same."""
    section = ""
    theirs_lines, our_lines = reference.splitlines(), ours.splitlines()
    for index in range(max(len(theirs_lines), len(our_lines))):
        theirs = theirs_lines[index] if index < len(theirs_lines) else "(nothing)"
        mine = our_lines[index] if index < len(our_lines) else "(nothing)"
        if theirs == mine:
            if theirs.startswith("["):
                section = theirs.split("#")[0].strip()
            continue
        where = section or "(top level)"
        key = mine.partition("=")[0].strip() if "=" in mine else theirs.partition("=")[0].strip()
        return f"{where} {key}: node 0 has {theirs.strip()!r}, this node has {mine.strip()!r}"
    return None

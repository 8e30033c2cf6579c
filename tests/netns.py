"""Hosts on one machine: each a Linux network namespace with an address of its own, on a bridge they share.

A test's launchers on one machine otherwise share one loopback: an address a process advertises that other hosts
could not reach (``127.0.0.1``, a name that resolves to loopback) still works there, and a lost host can only be
played by killing or stopping its processes, never by its network going silent. Here each host has its own
address (``10.77.0.<i+1>``; the machine itself is :attr:`Hosts.MACHINE`), its own host name (``host<i>``,
resolved through the namespace's own ``/etc/hosts``, which ``ip netns exec`` puts in place), and its link can be
cut: its side of the bridge goes down, and packets to and from it are dropped without a reset, as when a host is
powered off or its switch port fails.

Needs root (``CAP_NET_ADMIN``) and iproute2; :func:`unavailable` says why a machine cannot, for ``pytest.skip``.
One set of hosts at a time per machine: they all use ``10.77.0.0/24``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from contextlib import contextmanager


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def unavailable() -> str | None:
    """Why network namespaces cannot be made here, or None."""
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        return "iproute2 (ip) or util-linux (unshare) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = Hosts(1)  # all that a test does: a bridge, a namespace with its link, a command under its host name
    try:
        probe.up()
        subprocess.run(probe.command(0, ["true"]), check=True, capture_output=True, text=True)
    except (subprocess.CalledProcessError, OSError) as error:
        return f"{' '.join(getattr(error, 'cmd', []) or [])} failed: {getattr(error, 'stderr', '') or error}".strip()
    finally:
        probe.down()
    return None


class Hosts:
    """``count`` hosts; host ``i`` is namespace ``names[i]``, named ``host<i>``, at :meth:`address`."""

    def __init__(self, count: int):
        tag = uuid.uuid4().hex[:6]
        self.bridge = f"trbr{tag}"
        self.names = [f"tr{tag}h{i}" for i in range(count)]
        self.links = [f"tr{tag}v{i}" for i in range(count)]  # the bridge's side of each host's link

    MACHINE = "10.77.0.254"
    """The machine's own address on the bridge (a server every host reaches, such as an etcd cluster's member)."""

    @staticmethod
    def address(i: int) -> str:
        return f"10.77.0.{i + 1}"

    def up(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.MACHINE}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        hosts = "127.0.0.1 localhost\n" + "".join(f"{self.address(i)} host{i}\n" for i in range(len(self.names)))
        for i, (name, link) in enumerate(zip(self.names, self.links)):
            _ip("netns", "add", name)
            _ip("link", "add", link, "type", "veth", "peer", "name", "eth0", "netns", name)
            _ip("link", "set", link, "master", self.bridge, "up")
            _ip("-n", name, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
            _ip("-n", name, "link", "set", "eth0", "up")
            _ip("-n", name, "link", "set", "lo", "up")
            os.makedirs(f"/etc/netns/{name}", exist_ok=True)
            with open(f"/etc/netns/{name}/hosts", "w") as f:
                f.write(hosts)

    def down(self) -> None:
        for name, link in zip(self.names, self.links):
            subprocess.run(["ip", "link", "del", link], capture_output=True)
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
            shutil.rmtree(f"/etc/netns/{name}", ignore_errors=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)

    def command(self, i: int, argv: list[str]) -> list[str]:
        """``argv`` run on host ``i``: in its namespace, under its host name (the last process is ``argv``'s)."""
        return ["ip", "netns", "exec", self.names[i], "unshare", "--uts", "sh", "-c",
                f'hostname host{i} && exec "$@"', "sh", *argv]

    def cut(self, i: int) -> None:
        """Host ``i``'s link goes down: nothing reaches it or leaves it, and nobody is told."""
        _ip("link", "set", self.links[i], "down")

    def heal(self, i: int) -> None:
        """Host ``i``'s link comes back up."""
        _ip("link", "set", self.links[i], "up")


@contextmanager
def hosts(count: int):
    made = Hosts(count)
    try:
        made.up()
        yield made
    finally:
        made.down()

"""Hosts that share nothing but a network, on one machine: Linux network namespaces, each with
its own address on a bridge this module creates (``ip netns``, ``ip link``; needs root). A
process started with :attr:`Host.prefix` before its command runs "on" that host: it has its own
loopback, reaches the others and the bridge's own address (the machine itself, where a test's
object store listens), and nothing else.

Usage::

    with Hosts(3) as hosts:          # 10.x.y.11, .12, .13; the machine is hosts.gateway
        NodeProcess(..., host=hosts[0].address, prefix=hosts[0].prefix)

Everything is removed on exit: the namespaces (and with them their interfaces) and the bridge.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Host", "Hosts", "unavailable"]


@dataclass(frozen=True, slots=True)
class Host:
    name: str  # the namespace
    address: str  # its IPv4 address on the bridge

    @property
    def prefix(self) -> list[str]:
        """What runs a command on this host."""
        return ["ip", "netns", "exec", self.name]


def unavailable() -> str | None:
    """Why network namespaces cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    probe = f"dfprobe{secrets.token_hex(3)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


class Hosts:
    """``count`` network namespaces on a bridge of their own (see the module)."""

    def __init__(self, count: int) -> None:
        tag = secrets.token_hex(2)
        # A /24 per run, so two runs on one machine do not collide.
        subnet = f"10.{100 + int(tag[:2], 16) % 100}.{int(tag[2:], 16)}"
        self.gateway = f"{subnet}.1"
        self._bridge = f"dfbr{tag}"
        self._tag = tag
        self.hosts = [Host(f"df{tag}h{i}", f"{subnet}.{11 + i}") for i in range(count)]

    def __getitem__(self, index: int) -> Host:
        return self.hosts[index]

    def __len__(self) -> int:
        return len(self.hosts)

    def __enter__(self) -> Hosts:
        try:
            _ip("link", "add", self._bridge, "type", "bridge")
            _ip("addr", "add", f"{self.gateway}/24", "dev", self._bridge)
            _ip("link", "set", self._bridge, "up")
            for i, host in enumerate(self.hosts):
                outside, inside = f"df{self._tag}v{i}", f"df{self._tag}p{i}"
                _ip("netns", "add", host.name)
                _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
                _ip("link", "set", inside, "netns", host.name)
                _ip("link", "set", outside, "master", self._bridge)
                _ip("link", "set", outside, "up")
                _on(host, "ip", "addr", "add", f"{host.address}/24", "dev", inside)
                _on(host, "ip", "link", "set", inside, "up")
                _on(host, "ip", "link", "set", "lo", "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for host in self.hosts:  # deleting a namespace deletes its end of the veth, and so both
            subprocess.run(["ip", "netns", "del", host.name], capture_output=True)
        subprocess.run(["ip", "link", "del", self._bridge], capture_output=True)


def _ip(*args: str) -> None:
    _run(["ip", *args])


def _on(host: Host, *command: str) -> None:
    _run([*host.prefix, *command])


def _run(command: Sequence[str]) -> None:
    done = subprocess.run(list(command), capture_output=True, text=True)
    if done.returncode != 0:
        raise OSError(f"{' '.join(command)} failed: {done.stderr.strip()}")

"""Three network hosts on one Linux machine: namespaces on a bridge (needs root and ``ip``).

    with hosts(["gw", "n1", "n2"]) as net:
        net.address["n2"]               # "10.77.<k>.4"
        net.spawn("n2", "meshnet_node", "--port", "8000")
        net.shape("n2", rate="100mbit") # tc token bucket on both ends of n2's link
        net.cut("n2") / net.restore("n2")

Each host is a network namespace with one veth to a bridge in the root
namespace, which keeps an address too (``.1``), so a client in this process
can reach the gateway. Names carry a per-run suffix and the subnet is picked
at random per run, so two runs never collide; everything is removed on exit,
also when the block raises.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import select
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

__all__ = ["Hosts", "hosts", "unavailable"]

READY_TIMEOUT = 30.0


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None when they can."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the '{tool}' command (iproute2) is not installed"
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=20)


def _quiet(*cmd: str) -> None:
    subprocess.run(list(cmd), capture_output=True, timeout=20)


@dataclass
class Hosts:
    suffix: str
    subnet: str  # "10.77.<k>"
    bridge: str
    namespace: dict[str, str] = field(default_factory=dict)  # host -> netns name
    address: dict[str, str] = field(default_factory=dict)  # host -> IPv4
    inside: dict[str, str] = field(default_factory=dict)  # host -> veth in its netns
    outside: dict[str, str] = field(default_factory=dict)  # host -> veth on the bridge
    procs: list[subprocess.Popen[str]] = field(default_factory=list)

    def spawn(
        self, host: str, module: str, *args: str, env: dict[str, str] | None = None
    ) -> tuple[subprocess.Popen[str], str]:
        """``python -m module args`` inside ``host``; returns it and its URL from the ready line."""
        clean = {k: v for k, v in (env or os.environ).items() if not k.startswith("MESHNET_")}
        proc = subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                self.namespace[host],
                sys.executable,
                "-m",
                module,
                "--host",
                self.address[host],
                "--log-level",
                "warning",
                *args,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=clean,
        )
        self.procs.append(proc)
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], READY_TIMEOUT)
        line = proc.stdout.readline() if ready else ""
        if " listening on " not in line:
            raise RuntimeError(f"{module} in {host} did not start (ready line {line!r})")
        return proc, line.split(" listening on ", 1)[1].split()[0]

    def shape(self, host: str, *, rate: str, burst: str = "256kb", latency: str = "50ms") -> None:
        """Token-bucket ``host``'s link in both directions (tc tbf on each veth end)."""
        tbf = ["root", "tbf", "rate", rate, "burst", burst, "latency", latency]
        _ip(
            "netns",
            "exec",
            self.namespace[host],
            "tc",
            "qdisc",
            "replace",
            "dev",
            self.inside[host],
            *tbf,
        )
        subprocess.run(
            ["tc", "qdisc", "replace", "dev", self.outside[host], *tbf],
            check=True,
            capture_output=True,
            timeout=20,
        )

    def unshape(self, host: str) -> None:
        _quiet(
            "ip",
            "netns",
            "exec",
            self.namespace[host],
            "tc",
            "qdisc",
            "del",
            "dev",
            self.inside[host],
            "root",
        )
        _quiet("tc", "qdisc", "del", "dev", self.outside[host], "root")

    def cut(self, host: str) -> None:
        """Take ``host``'s link down at the bridge: its packets vanish (no RST, no ICMP)."""
        _ip("link", "set", self.outside[host], "down")

    def restore(self, host: str) -> None:
        _ip("link", "set", self.outside[host], "up")


@contextlib.contextmanager
def hosts(names: Sequence[str]) -> Iterator[Hosts]:
    """Namespaces ``names`` on a fresh bridge; removed (with their processes) on exit."""
    reason = unavailable()
    if reason is not None:
        raise RuntimeError(reason)
    suffix = secrets.token_hex(3)
    net = Hosts(suffix, f"10.77.{secrets.randbelow(250) + 1}", f"mnbr{suffix}")
    try:
        _ip("link", "add", net.bridge, "type", "bridge")
        _ip("addr", "add", f"{net.subnet}.1/24", "dev", net.bridge)
        _ip("link", "set", net.bridge, "up")
        for i, host in enumerate(names):
            ns, inside, outside = f"mn-{host}-{suffix}", f"mn{i}i{suffix}", f"mn{i}o{suffix}"
            net.namespace[host], net.inside[host], net.outside[host] = ns, inside, outside
            net.address[host] = f"{net.subnet}.{i + 2}"
            _ip("netns", "add", ns)
            _ip("link", "add", inside, "type", "veth", "peer", "name", outside)
            _ip("link", "set", inside, "netns", ns)
            _ip("link", "set", outside, "master", net.bridge)
            _ip("link", "set", outside, "up")
            _ip("-n", ns, "addr", "add", f"{net.address[host]}/24", "dev", inside)
            _ip("-n", ns, "link", "set", inside, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield net
    finally:
        for proc in net.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in net.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for host, ns in net.namespace.items():
            _quiet("ip", "link", "del", net.outside[host])  # takes its peer with it
            _quiet("ip", "netns", "del", ns)
        _quiet("ip", "link", "del", net.bridge)

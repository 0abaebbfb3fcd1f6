"""Two network namespaces joined by an emulated WAN link, for the bench and its tests.

``emulated_link(rtt_ms, rate_mbit)`` creates a bank namespace and a partner
namespace, each with loopback up and one end of the link, addressed from the
link-local /30 ``169.254.77.0/30`` (the bank .1, the partner .2): nothing on
the link can reach, or be reached from, any other network. The link is
``tc netem`` on a veth pair where the kernel has ``sch_netem``, otherwise two
TAP devices joined by ``bank.lab.bench.delay_line``. Every process started with
``link.run``/``link.command`` runs inside a namespace; on the way out
(an exception, Ctrl-C or SIGTERM included) the namespaces, the devices in them
and the delay line are removed.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from parties.errors import ConfigError

__all__ = ["BANK_ADDRESS", "PARTNER_ADDRESS", "WanLink", "emulated_link", "netem_available", "privilege_problem"]

logger = logging.getLogger(__name__)

BANK_ADDRESS, PARTNER_ADDRESS, PREFIX = "169.254.77.1", "169.254.77.2", 30
_CAP_NET_ADMIN, _CAP_SYS_ADMIN = 12, 21  # ``ip netns add`` mounts the namespace: it needs both
_counter = itertools.count()


def _effective_capabilities() -> int:
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return int(line.split()[1], 16)
    return 0


def privilege_problem(
    euid: int | None = None, capabilities: int | None = None, tun: Path = Path("/dev/net/tun"),
    tools: tuple[str, ...] = ("ip", "tc"), need_tun: bool = True,
) -> str | None:
    """Why this process cannot build the emulated link, in an operator's words; ``None`` if it can.

    ``euid`` and ``capabilities`` (the CapEff bit mask) default to this process's own; ``need_tun``: the
    link will be the userspace delay line (no netem)."""
    euid = os.geteuid() if euid is None else euid
    capabilities = _effective_capabilities() if capabilities is None else capabilities
    needed = (1 << _CAP_NET_ADMIN) | (1 << _CAP_SYS_ADMIN)
    if euid != 0 and capabilities & needed != needed:
        return ("the WAN bench (--rtt-ms/--rate-mbit) creates network namespaces: it needs root, or CAP_NET_ADMIN "
                "and CAP_SYS_ADMIN; run it as root (e.g. sudo), or leave out --rtt-ms and --rate-mbit for loopback")
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        return f"the WAN bench needs the {' and '.join(missing)} command (iproute2); install it"
    if need_tun and not tun.exists():
        return (f"the WAN bench needs {tun} for its userspace link (this kernel has no tc netem either); "
                "create it (mknod /dev/net/tun c 10 200) or run where it exists")
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and result.returncode != 0:
        raise ConfigError(f"ip {' '.join(args)}: {result.stderr.strip()}")
    return result


def netem_available(namespace: str) -> bool:
    """Whether ``tc qdisc ... netem`` works here (tried on ``namespace``'s loopback, then removed)."""
    probe = ["ip", "netns", "exec", namespace, "tc", "qdisc"]
    ok = subprocess.run([*probe, "add", "dev", "lo", "root", "netem", "delay", "1ms"], capture_output=True).returncode == 0
    if ok:
        subprocess.run([*probe, "del", "dev", "lo", "root"], capture_output=True)
    return ok


@dataclass
class WanLink:
    """What ``emulated_link`` built: the namespaces, each side's address, the link's kind."""

    rtt_ms: float
    rate_mbit: float | None
    bank_ns: str
    partner_ns: str
    kind: Literal["netem", "delay line"] = "delay line"
    congestion: str | None = None
    _processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def namespaces(self) -> tuple[str, str]:
        return self.bank_ns, self.partner_ns

    def command(self, namespace: str, argv: list[str]) -> list[str]:
        """``argv`` run inside ``namespace``."""
        if namespace not in self.namespaces:
            raise ValueError(f"{namespace!r} is not one of this link's namespaces")
        return ["ip", "netns", "exec", namespace, *argv]

    def popen(self, namespace: str, argv: list[str], **kwargs: object) -> subprocess.Popen[bytes]:
        """Start ``argv`` inside ``namespace``; it is stopped when the link is removed, if still running."""
        proc = subprocess.Popen(self.command(namespace, argv), **kwargs)  # type: ignore[call-overload]
        self._processes.append(proc)
        return proc

    def transfer_seconds(self, nbytes: float) -> float:
        """Seconds to put ``nbytes`` on the link at its rate (0 when unlimited)."""
        return 0.0 if not self.rate_mbit else nbytes * 8 / (self.rate_mbit * 1e6)


def _stop(proc: subprocess.Popen[bytes], timeout: float = 5.0) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """A SIGTERM unwinds like Ctrl-C, so ``finally`` blocks remove what was built (main thread only)."""
    if sys.platform != "linux" or not _is_main_thread():
        yield
        return

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _is_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _start_delay_line(link: WanLink, taps: tuple[str, str], work: Path) -> subprocess.Popen[bytes]:
    ready = work / "delay-line.ready"
    argv = [sys.executable, "-m", "bank.lab.bench.delay_line", "--tap", taps[0], "--tap", taps[1],
            "--delay-ms", str(link.rtt_ms / 2), "--ready-file", str(ready)]
    if link.rate_mbit:
        argv += ["--rate-mbit", str(link.rate_mbit)]
    with open(work / "delay-line.log", "wb") as log:  # the child keeps its own copy
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    link._processes.append(proc)
    deadline = time.monotonic() + 15
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise ConfigError(f"the delay line did not start: {(work / 'delay-line.log').read_text(errors='replace')}")
        time.sleep(0.02)
    return proc


@contextlib.contextmanager
def emulated_link(
    rtt_ms: float, rate_mbit: float | None = None, congestion: str | None = None, force: str | None = None,
) -> Iterator[WanLink]:
    """Build the namespaces and the link, yield them, and remove everything afterwards.

    ``congestion``: the namespaces' default TCP congestion control (``net.ipv4.tcp_congestion_control``);
    ``force``: "netem" or "delay line" instead of the first that works (tests)."""
    problem = privilege_problem(need_tun=False)  # whether the delay line is needed is known further down
    if problem:
        raise ConfigError(problem)
    tag = f"{os.getpid()}-{next(_counter)}"
    short = tag.replace("-", "x")[-9:]  # interface names: at most 15 characters
    link = WanLink(rtt_ms, rate_mbit, f"cutlayer-{tag}-bank", f"cutlayer-{tag}-partner", congestion=congestion)
    created: list[str] = []
    with _sigterm_as_interrupt(), tempfile.TemporaryDirectory(prefix="cutlayer-wan-") as tmp:
        try:
            for ns in link.namespaces:
                _ip("netns", "add", ns)
                created.append(ns)
                _ip("-n", ns, "link", "set", "lo", "up")
                # No IPv6 on the link: its autoconfiguration chatter would share the emulated link with the test.
                subprocess.run(link.command(ns, ["sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1",
                                                 "net.ipv6.conf.default.disable_ipv6=1"]), capture_output=True)
                if congestion:
                    sysctl = subprocess.run(link.command(ns, ["sysctl", "-qw", f"net.ipv4.tcp_congestion_control={congestion}"]),
                                            capture_output=True, text=True)
                    if sysctl.returncode != 0:
                        raise ConfigError(f"--congestion {congestion}: this kernel refuses it ({sysctl.stderr.strip()}); "
                                          f"it offers: {Path('/proc/sys/net/ipv4/tcp_available_congestion_control').read_text().strip()}")
            use_netem = force == "netem" or (force is None and netem_available(link.bank_ns))
            problem = None if use_netem else privilege_problem()
            if problem:
                raise ConfigError(problem)
            devices = (f"clb{short}", f"clp{short}")
            if use_netem:
                link.kind = "netem"
                _ip("link", "add", devices[0], "netns", link.bank_ns, "type", "veth", "peer", "name", devices[1],
                    "netns", link.partner_ns)
            else:
                _start_delay_line(link, devices, Path(tmp))
                _ip("link", "set", devices[0], "netns", link.bank_ns)
                _ip("link", "set", devices[1], "netns", link.partner_ns)
            for ns, dev, address in ((link.bank_ns, devices[0], BANK_ADDRESS),
                                     (link.partner_ns, devices[1], PARTNER_ADDRESS)):
                _ip("-n", ns, "addr", "add", f"{address}/{PREFIX}", "dev", dev)
                _ip("-n", ns, "link", "set", dev, "up")
                if use_netem:
                    netem = ["delay", f"{rtt_ms / 2}ms"] + (["rate", f"{rate_mbit}mbit"] if rate_mbit else [])
                    tc = subprocess.run(link.command(ns, ["tc", "qdisc", "add", "dev", dev, "root", "netem", *netem]),
                                        capture_output=True, text=True)
                    if tc.returncode != 0:
                        raise ConfigError(f"tc netem on {dev}: {tc.stderr.strip()}")
            logger.info("emulated link (%s): %s ms RTT, %s Mbit/s, namespaces %s", link.kind, rtt_ms,
                        rate_mbit or "unlimited", link.namespaces)
            yield link
        finally:
            for proc in reversed(link._processes):
                _stop(proc)
            for ns in created:
                _ip("netns", "del", ns, check=False)

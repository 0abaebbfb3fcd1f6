"""The WAN harness: the emulated link adds the RTT and rate it claims, leaves nothing behind, and refuses
plainly where it cannot run; the bench's WAN flags are checked at the command line."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from bank.lab.__main__ import main as bank_main
from bank.lab.bench import netns
from bank.lab.bench.netns import BANK_ADDRESS, PARTNER_ADDRESS, emulated_link, privilege_problem
from bank.lab.bench.wan import time_to_target
from parties.cli import run_cli
from parties.errors import ConfigError
from parties.transport import sockets
from parties.transport.edges import bind_socket

ROOT = Path(__file__).resolve().parents[1]
can_build = pytest.mark.skipif(
    privilege_problem() is not None, reason=f"cannot build network namespaces here: {privilege_problem()}"
)

# A raw TCP probe, no TLS: the server echoes SIZE bytes for SIZE bytes; the client sends them TRIPS times, each
# after the last echo, and prints each round trip in ms. OPTIONS: "party" sets the party sockets' options
# (``parties.transport.sockets``) on both ends before they connect, "bbr" asks for BBR instead, "none" neither.
PROBE = r"""
import json, socket, sys, time
from parties.transport import sockets
role, host, size, trips, options = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
def prepare(s):
    if options == "party":
        sockets.tune(s)
    elif options == "bbr":
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, b"bbr")
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
def full(c, n):
    got = 0
    while got < n:
        chunk = c.recv(1 << 20)
        if not chunk:
            raise SystemExit(0)
        got += len(chunk)
if role == "server":
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); prepare(s)
    s.bind((host, 7777)); s.listen(1)
    c, _ = s.accept()
    while True:
        full(c, size); c.sendall(b"y" * size)
deadline = time.monotonic() + 10
while True:
    c = socket.socket(); prepare(c)
    try:
        c.connect((host, 7777)); break
    except OSError:
        c.close()
        if time.monotonic() > deadline: raise
        time.sleep(0.05)
times = []
for _ in range(trips):
    start = time.perf_counter(); c.sendall(b"x" * size); full(c, size); times.append(1e3 * (time.perf_counter() - start))
print(json.dumps(times))
"""


def _probe(link: netns.WanLink, size: int, trips: int, options: str = "none") -> list[float]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    link.popen(link.partner_ns, [sys.executable, "-c", PROBE, "server", PARTNER_ADDRESS, str(size), "0", options],
               env=env)
    run = subprocess.run(link.command(link.bank_ns, [sys.executable, "-c", PROBE, "client", PARTNER_ADDRESS,
                                                     str(size), str(trips), options]),
                         capture_output=True, text=True, timeout=60, env=env)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


def _gone(link: netns.WanLink) -> None:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(ns in listed for ns in link.namespaces)
    assert not any(Path("/var/run/netns", ns).exists() for ns in link.namespaces)
    devices = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert all(proc.poll() is not None for proc in link._processes)
    assert not any(name in devices for name in ("clb", "clp"))  # the root namespace never holds the link's ends


@can_build
@pytest.mark.parametrize("kind", ["delay line", "netem"])
def test_the_link_adds_its_rtt_and_rate_and_leaves_nothing_behind(kind: str) -> None:
    if kind == "netem":
        with emulated_link(0) as probe:
            if probe.kind != "netem":
                pytest.skip("this kernel has no sch_netem")
    with emulated_link(20, force=kind) as link:
        assert link.kind == kind
        times = _probe(link, 100, 12)[2:]  # the first trips include the connection and ARP
        assert 20 <= min(times) and sorted(times)[len(times) // 2] < 20 + 8, times
    _gone(link)
    with emulated_link(2, rate_mbit=8, force=kind) as link:
        # 60 KB each way at 8 Mbit/s: 60 ms each way on the wire, once the window has opened
        times = _probe(link, 60_000, 6)
        assert 2 + 120 <= min(times) < 2 + 120 + 60, times
    _gone(link)


@can_build
def test_everything_is_removed_when_the_body_raises() -> None:
    with pytest.raises(RuntimeError, match="boom"), emulated_link(10, rate_mbit=50) as link:
        sleeper = link.popen(link.bank_ns, [sys.executable, "-c", "import time; time.sleep(60)"])
        listed = subprocess.run(link.command(link.bank_ns, ["ip", "-o", "addr"]), capture_output=True, text=True).stdout
        assert f"{BANK_ADDRESS}/30" in listed
        raise RuntimeError("boom")
    assert sleeper.poll() is not None
    _gone(link)


def _median(times: list[float]) -> float:
    return sorted(times)[len(times) // 2]


@can_build
def test_a_step_sized_exchange_takes_one_round_trip_with_the_party_socket_options() -> None:
    """74 KB each way at 20 ms RTT: the party sockets' options give one round trip; BBR (where the kernel has
    it) paces each message over a whole RTT and takes two. The first trips open the window."""
    with emulated_link(20) as link:
        party = _probe(link, 74_000, 16, "party")[6:]
    assert _median(party) < 1.3 * 20, party
    if "bbr" in Path("/proc/sys/net/ipv4/tcp_available_congestion_control").read_text().split():
        with emulated_link(20) as link:
            bbr = _probe(link, 74_000, 16, "bbr")[6:]
        assert _median(bbr) > 1.6 * 20, bbr  # the cause: if this fails, BBR no longer costs the extra RTT


def test_party_sockets_have_their_options_before_they_connect() -> None:
    name = sockets.congestion_control()
    if sys.platform == "linux":
        assert name in sockets.CONGESTION_PREFERENCE  # reno is always allowed
    listener = bind_socket("127.0.0.1", 0)
    listener.listen(1)
    with listener, sockets.connect("127.0.0.1", listener.getsockname()[1], 5.0) as client:
        server, _ = listener.accept()
        with server:
            for sock in (listener, client, server):
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
                if name is not None:
                    assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).rstrip(b"\0").decode() == name
    assert dict(((level, option), value) for level, option, value in sockets.socket_options())[
        (socket.IPPROTO_TCP, socket.TCP_NODELAY)] == 1


def test_without_privileges_it_refuses_with_what_to_do(tmp_path: Path) -> None:
    cap_net_admin, cap_sys_admin = 1 << 12, 1 << 21
    problem = privilege_problem(euid=1000, capabilities=0, tun=tmp_path, tools=())
    assert problem is not None and "needs root, or CAP_NET_ADMIN and CAP_SYS_ADMIN" in problem
    assert "leave out --rtt-ms and --rate-mbit" in problem
    assert privilege_problem(euid=1000, capabilities=cap_net_admin, tun=tmp_path, tools=()) == problem
    assert privilege_problem(euid=1000, capabilities=cap_net_admin | cap_sys_admin, tun=tmp_path, tools=()) is None
    assert privilege_problem(euid=0, capabilities=0, tun=tmp_path, tools=()) is None
    no_tun = privilege_problem(euid=0, capabilities=0, tun=tmp_path / "tun", tools=())
    assert no_tun is not None and "tun" in no_tun
    assert privilege_problem(euid=0, capabilities=0, tun=tmp_path / "tun", tools=(), need_tun=False) is None  # netem
    no_ip = privilege_problem(euid=0, capabilities=0, tun=tmp_path, tools=("no-such-tool-cutlayer",))
    assert no_ip is not None and "no-such-tool-cutlayer" in no_ip


def test_the_link_is_refused_before_anything_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(netns, "_effective_capabilities", lambda: 0)
    with pytest.raises(ConfigError, match="needs root"), emulated_link(20):
        pytest.fail("the body must not run")


@pytest.mark.parametrize("flags, message", [
    (["--rtt-ms", "-1"], "argument --rtt-ms: -1 ms: a round-trip time is between 0 and 10000 ms"),
    (["--rtt-ms", "nan"], "argument --rtt-ms: 'nan' is not a finite number"),
    (["--rtt-ms", "20", "--rate-mbit", "0"], "argument --rate-mbit: 0 Mbit/s: a rate is above 0 and at most"),
    (["--rtt-ms", "20", "--target-auc", "1.5"], "argument --target-auc: 1.5: a ROC AUC target is above 0 and at most 1"),
    (["--rtt-ms", "20", "--congestion", "bbr;x"], "argument --congestion: 'bbr;x' is not a congestion control name"),
], ids=["negative-rtt", "nan-rtt", "zero-rate", "auc-above-1", "congestion-name"])
def test_bad_wan_flags_are_refused_at_the_command_line(capsys: pytest.CaptureFixture[str], flags: list[str],
                                                        message: str) -> None:
    with pytest.raises(SystemExit) as exit_:
        bank_main(["bench", *flags])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--congestion", "cubic"], "--congestion, --target-auc and --modes belong to the WAN bench"),
    (["--modes", "exact"], "--congestion, --target-auc and --modes belong to the WAN bench"),
    (["--rtt-ms", "20", "--wire-precision", "int8"], "leave out --wire-precision"),
    (["--rtt-ms", "20", "--modes", "exact,fast"], "--modes: fast; choose from exact, int8, efficient"),
    (["--rtt-ms", "20", "--modes", ","], "--modes: none given"),
], ids=["congestion-without-link", "modes-without-link", "precision-on-link", "unknown-mode", "no-mode"])
def test_wan_flags_that_do_not_go_together_are_one_line(capsys: pytest.CaptureFixture[str], flags: list[str],
                                                        message: str) -> None:
    with pytest.raises(SystemExit) as exit_:
        run_cli(lambda: bank_main(["bench", *flags]))
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_time_to_target_sums_training_seconds_to_the_first_epoch_that_reaches_it() -> None:
    history = pd.DataFrame({"train_seconds": [1.0, 2.0, 4.0, 8.0], "val_roc_auc": [0.8, 0.92, 0.95, 0.91]})
    assert time_to_target(history, 0.93) == (7.0, "val_roc_auc")
    assert time_to_target(history, 0.99) == (None, "val_roc_auc")
    history["test_roc_auc"] = [0.94, 0.5, 0.5, 0.5]  # when the history has it, the test column decides
    assert time_to_target(history, 0.93) == (1.0, "test_roc_auc")

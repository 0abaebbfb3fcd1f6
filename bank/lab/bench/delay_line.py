"""A userspace WAN link between two TAP devices: a fixed one-way delay and, optionally, a rate.

``python -m bank.lab.bench.delay_line --tap A --tap B --delay-ms 10 --rate-mbit 100 --ready-file F``
creates the two TAP devices (in its own network namespace; ``bank.lab.bench.netns``
then moves them where they belong) and forwards every Ethernet frame read from
one to the other. For kernels without ``sch_netem``.

Each direction is a bottleneck link: a frame waits for the frames before it to
be serialised at the rate, then travels for the one-way delay. A frame that
finds more than ``buffer`` bytes queued is dropped (a drop-tail router). One
selector loop serves both directions (no GIL handed between threads while a
frame waits), under SCHED_FIFO where allowed, so the link's own work runs
ahead of the parties' on a machine whose cores they share.
"""

from __future__ import annotations

import argparse
import collections
import fcntl
import json
import os
import selectors
import signal
import struct
import threading
import time
from pathlib import Path

__all__ = ["DelayLine", "open_tap"]

_TUNSETIFF, _TUNSETOFFLOAD = 0x400454CA, 0x400454D0
_IFF_TAP, _IFF_NO_PI, _IFF_VNET_HDR = 0x0002, 0x1000, 0x4000
_TUN_F_CSUM, _TUN_F_TSO4, _TUN_F_TSO6 = 0x01, 0x02, 0x04
_FRAME = 1 << 17  # larger than any frame a TAP hands over, a 64 KB TSO frame and its header included


def open_tap(name: str) -> int:
    """A new TAP device ``name`` in this process's network namespace; it goes away when the fd closes.

    With checksum and TCP segmentation offload, as a NIC has: the kernel hands over up to 64 KB per frame,
    each with a virtio-net header that the other TAP (set up alike) takes as it is. A step's message is then
    a few frames for this loop to move, not fifty."""
    fd = os.open("/dev/net/tun", os.O_RDWR)
    try:
        fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH", name.encode(), _IFF_TAP | _IFF_NO_PI | _IFF_VNET_HDR))
        fcntl.ioctl(fd, _TUNSETOFFLOAD, _TUN_F_CSUM | _TUN_F_TSO4 | _TUN_F_TSO6)
    except BaseException:
        os.close(fd)
        raise
    return fd


class _Direction:
    """Frames from ``source`` to ``sink``: serialised at ``rate`` bytes/s (0: at once), then delayed."""

    def __init__(self, source: int, sink: int, delay: float, rate: float, buffer: int) -> None:
        self.source, self.sink, self.delay, self.rate, self.buffer = source, sink, delay, rate, buffer
        self.queue: collections.deque[tuple[float, bytes]] = collections.deque()  # due times only grow
        self.busy_until = 0.0  # when the link finishes serialising what it holds
        self.frames = self.dropped = 0

    def take(self, now: float) -> None:
        """Queue every frame ``source`` holds, each with the time it is due at ``sink``."""
        while True:
            try:
                frame = os.read(self.source, _FRAME)
            except BlockingIOError:
                return
            self.frames += 1
            if self.rate:
                start = max(now, self.busy_until)
                if (start - now) * self.rate > self.buffer:
                    self.dropped += 1
                    continue
                self.busy_until = start + len(frame) / self.rate
                self.queue.append((self.busy_until + self.delay, frame))
            else:
                self.queue.append((now + self.delay, frame))

    def give(self, now: float) -> float | None:
        """Write every frame due by ``now``; return when the next one is due (``None``: none queued)."""
        while self.queue and self.queue[0][0] <= now:
            frame = self.queue.popleft()[1]
            try:
                os.write(self.sink, frame)
            except OSError:
                pass  # the far device is down or gone: a lost frame, as on a real link
        return self.queue[0][0] if self.queue else None


class DelayLine:
    """Both directions between the TAP fds ``a`` and ``b``, in one loop: no thread hands the GIL to another
    while a frame waits."""

    def __init__(self, a: int, b: int, delay: float, rate_bytes: float = 0.0, buffer: int = 0) -> None:
        self.directions = [_Direction(a, b, delay, rate_bytes, buffer), _Direction(b, a, delay, rate_bytes, buffer)]
        for fd in (a, b):
            os.set_blocking(fd, False)

    def run(self, stop: threading.Event) -> None:
        sources = {d.source: d for d in self.directions}
        with selectors.SelectSelector() as selector:  # select(2) waits in microseconds, epoll in whole milliseconds
            for fd in sources:
                selector.register(fd, selectors.EVENT_READ)
            timeout: float | None = 0.5
            while not stop.is_set():
                for key, _ in selector.select(timeout):
                    sources[key.fd].take(time.monotonic())  # type: ignore[index]
                now = time.monotonic()
                due = [t for t in (d.give(now) for d in self.directions) if t is not None]
                timeout = max(0.0, min(due) - time.monotonic()) if due else 0.5


def _realtime() -> bool:
    """Run ahead of the parties when a frame is due, as a real link takes no CPU from its ends (root only)."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))
    except (OSError, AttributeError):
        return False
    return True


def _buffer_bytes(delay: float, rate_bytes: float) -> int:
    """One bandwidth-delay product of queue (the usual router sizing), at least 64 full frames."""
    return int(max(rate_bytes * 2 * delay, 64 * 1514))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bank.lab.bench.delay_line", description=__doc__.splitlines()[0])
    parser.add_argument("--tap", action="append", required=True, help="a TAP device to create; give two")
    parser.add_argument("--delay-ms", type=float, required=True, help="one-way delay")
    parser.add_argument("--rate-mbit", type=float, default=0.0, help="link rate each way (default: unlimited)")
    parser.add_argument("--ready-file", type=Path, required=True, help="written once both devices exist")
    args = parser.parse_args(argv)
    if len(args.tap) != 2:
        parser.error("give --tap twice")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    fds = [open_tap(name) for name in args.tap]
    delay, rate = args.delay_ms / 1e3, args.rate_mbit * 1e6 / 8
    line = DelayLine(fds[0], fds[1], delay, rate, _buffer_bytes(delay, rate))
    realtime = _realtime()
    args.ready_file.write_text(json.dumps({"pid": os.getpid(), "taps": args.tap, "realtime": realtime}) + "\n")
    line.run(stop)
    counts = [(d.frames, d.dropped) for d in line.directions]
    print(json.dumps({"frames": [c[0] for c in counts], "dropped": [c[1] for c in counts]}), flush=True)
    return 0  # closing the fds (at exit) removes the devices


if __name__ == "__main__":
    raise SystemExit(main())

"""PSI hashing and blinding as Ray tasks on the party's own cluster (``--ray-address``).

A party past one machine runs its curve math on a Ray cluster it already has
(``ray start --head`` on one node, ``ray start --address HEAD:6379`` on the
others and on the service's own machine, cutlayer with its ``ray`` extra on
every node). The slices are those of the local pool (``alignment.parallel``)
and the functions the same, so the bytes are the same; only where they run
changes.

What the cluster sees: this party's own IDs and its PSI session keys. It must
be the party's own, inside its own network; nothing of it is shared with a peer,
and no peer ever talks to it.

The driver runs in a child process. Ray ends a driver whose cluster head is
lost; in the service's own process that would take every job down with it,
training included. Here the child ends, the call under way raises
``ComputeUnavailable``, and the next call starts a new child. The child is also
where Ray is imported: the service's process never joins a cluster itself.

Back-pressure: at most ``in_flight`` slices (twice the cluster's CPUs, or twice
``workers`` when given) are sent and not yet answered, and results come back in
order, so neither side holds more than that many slices however slow the
caller that consumes them. Calls through one pool take turns.

Failures: tasks are not retried. A cluster that cannot be reached, a node or a
worker that dies, a Ray error of any kind, or a node whose curve math gives
other bytes raises ``ComputeUnavailable``, which aborts the PSI session (the
peer is told, nothing is committed); the alignment can be run again once the
cluster is whole.
"""

from __future__ import annotations

import hashlib
import logging
import multiprocessing
import os
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import CancelledError
from itertools import islice
from multiprocessing.connection import Connection
from typing import Any

from alignment import curve
from alignment.parallel import SlicePool, _worker_init
from parties.errors import ComputeUnavailable
from parties.settings import parse_ray_address as parse_address

__all__ = ["RayPool", "parse_address"]

logger = logging.getLogger(__name__)

#: Seconds to wait for a TCP connection to the head before calling the cluster unreachable.
CONNECT_SECONDS = 5.0
#: Seconds for the driver to join the cluster and check its nodes.
JOIN_SECONDS = 180.0
#: While a call waits, how often the head's port is tried: a head that refuses connections ends the call.
HEAD_PROBE_SECONDS = 3.0


def _check_reachable(address: str) -> None:
    """Refuse at once, with the reason, an address whose head does not answer (Ray itself waits a minute)."""
    if address == "auto":
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_SECONDS):
            pass
    except OSError as exc:
        raise ComputeUnavailable(f"the Ray cluster at {address} cannot be reached: {exc}") from exc


def fingerprint() -> str:
    """What this code computes for fixed IDs, a fixed DST and a fixed key: every node must compute the same."""
    points = curve.hash_to_curve([b"cutlayer", b"", "é".encode()], curve.psi_dst("fingerprint"))
    key = hashlib.sha256(b"cutlayer fingerprint key").digest()
    return hashlib.sha256(points + curve.blind(key, points, validate=False)).hexdigest()


def _run(fn: Callable[[object], bytes], part: object) -> bytes:
    return fn(part)


# --- the driver: a child process, the only one that imports Ray ---------------------------------------------


def _driver_main(address: str, conn: Connection, owner: int, expected: str) -> None:
    _worker_init(owner)  # deaf to Ctrl-C, and ends when the service does
    inbox: queue.Queue[tuple[Any, ...]] = queue.Queue()

    def read() -> None:  # always reading: a parent sending a slice never waits on a driver sending a result
        try:
            while True:
                inbox.put(conn.recv())
        except (EOFError, OSError):
            inbox.put(("eof",))

    threading.Thread(target=read, daemon=True, name="driver-inbox").start()
    try:
        import ray

        ray.init(address=address, namespace="cutlayer-psi", log_to_driver=False, logging_level=logging.WARNING,
                 configure_logging=False)
        cpus = int(ray.cluster_resources().get("CPU", 0))
        if cpus < 1:
            raise RuntimeError("it has no CPUs")
        task = ray.remote(num_cpus=1, max_retries=0)(_run)
        checked: set[str] = set()
        _check_nodes(ray, expected, checked)
    except Exception as exc:
        conn.send(("refused", f"could not run PSI on the Ray cluster at {address}: {exc}"))
        return
    conn.send(("ready", cpus))
    while True:
        message = inbox.get()
        if message[0] != "call":  # "close", or the parent gone
            ray.shutdown()
            return
        try:
            _check_nodes(ray, expected, checked)  # a node that joined since
            fn_ref = ray.put(message[1])  # the key and the DST travel once, not once a slice
        except Exception as exc:
            conn.send(("failed", f"{type(exc).__name__}: {exc}"))
            fn_ref = None
        _serve_call(ray, task, fn_ref, inbox, conn)


def _check_nodes(ray: Any, expected: str, checked: set[str]) -> None:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = [n["NodeID"] for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get("CPU")]
    new = [n for n in nodes if n not in checked]
    probe = ray.remote(num_cpus=1, max_retries=0)(fingerprint)
    refs = [probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False)).remote() for n in new]
    for node, theirs in zip(new, ray.get(refs, timeout=JOIN_SECONDS)):
        if theirs != expected:
            raise RuntimeError(f"node {node[:12]} computes other PSI bytes than this party: install the same "
                               "cutlayer on every node")
        checked.add(node)


def _serve_call(ray: Any, task: Any, fn_ref: Any, inbox: queue.Queue[tuple[Any, ...]], conn: Connection) -> None:
    """Run the slices the parent sends, answer in order; until the parent's ``end``, answered ``done``."""
    pending: list[Any] = []
    failed = fn_ref is None
    while True:
        try:
            message = inbox.get(timeout=0.02) if pending else inbox.get()
        except queue.Empty:
            message = None
        if message is not None:
            kind = message[0]
            if kind == "slice" and not failed:
                pending.append(task.remote(fn_ref, message[1]))
            elif kind in ("end", "eof", "close"):
                for ref in pending:
                    ray.cancel(ref, force=True)
                if kind == "end":
                    conn.send(("done",))
                else:
                    inbox.put(message)  # for the loop above, which then leaves
                return
            continue
        try:
            ready, _ = ray.wait(pending[:1], timeout=0)
            if not ready:
                continue
            conn.send(("result", ray.get(pending.pop(0))))
        except ray.exceptions.RayTaskError as exc:
            failed = True
            cause = exc.cause
            if isinstance(cause, ValueError):  # a bad point from the peer: the parent names it
                conn.send(("bad point", str(cause)))
            else:
                conn.send(("failed", f"a PSI task failed: {cause!r}"))
        except Exception as exc:  # a worker or node lost, the object store, anything of Ray's
            failed = True
            conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        if failed:
            for ref in pending:
                ray.cancel(ref, force=True)
            pending.clear()


# --- the pool, in the service's process ---------------------------------------------------------------------


class RayPool(SlicePool):
    """``SlicePool`` on a Ray cluster, through a driver process started on first use (or ``start``)."""

    def __init__(self, address: str, workers: int | None = None) -> None:
        self.address = parse_address(address)
        self._asked = workers
        self.workers = workers or 1
        self.in_flight = 2 * self.workers
        self._driver: tuple[multiprocessing.process.BaseProcess, Connection] | None = None
        self._lock = threading.Lock()  # one call at a time through the driver
        self._closing = threading.Event()
        self.sent = 0  # slices of the current call sent to the driver (for the back-pressure test)

    @property
    def parallel(self) -> bool:
        return True  # every batch of INLINE_BELOW or more goes to the cluster, whatever the workers

    def _connected(self) -> Connection:
        if self._driver is not None and self._driver[0].is_alive():
            return self._driver[1]
        self._stop_driver()
        _check_reachable(self.address)
        ctx = multiprocessing.get_context("forkserver")
        ours, theirs = ctx.Pipe()
        process = ctx.Process(target=_driver_main, args=(self.address, theirs, os.getpid(), fingerprint()),
                              daemon=True, name="cutlayer-ray-driver")
        process.start()
        theirs.close()
        self._driver = (process, ours)
        if not ours.poll(JOIN_SECONDS):
            self._stop_driver()
            raise ComputeUnavailable(f"the Ray cluster at {self.address} did not answer in {JOIN_SECONDS:.0f} s")
        answer = self._recv_raw()
        if answer[0] != "ready":
            self._stop_driver()
            raise ComputeUnavailable(answer[1])
        cpus = int(answer[1])
        self.workers = self._asked or cpus
        self.in_flight = 2 * self.workers
        logger.info("PSI runs on the Ray cluster at %s: %d CPUs, %d slices in flight at most",
                    self.address, cpus, self.in_flight)
        return ours

    def _recv_raw(self) -> tuple[Any, ...]:
        assert self._driver is not None
        try:
            return self._driver[1].recv()
        except (EOFError, OSError):
            self._stop_driver()
            raise ComputeUnavailable(self._lost()) from None

    def _lost(self) -> str:
        return (f"the Ray cluster at {self.address} went away under a PSI task (its head, a node or a worker died, "
                "and Ray ended this party's driver); the session is aborted: run the alignment again once the "
                "cluster is whole")

    def _recv(self, cancel: threading.Event | None) -> tuple[Any, ...]:
        assert self._driver is not None
        process, conn = self._driver
        probe_at = time.monotonic() + HEAD_PROBE_SECONDS
        while True:
            if (cancel is not None and cancel.is_set()) or self._closing.is_set():
                raise CancelledError("blinding cancelled")
            if conn.poll(0.2):
                return self._recv_raw()
            if time.monotonic() > probe_at:  # Ray's driver waits a minute for a lost head; a refused port is enough
                probe_at = time.monotonic() + HEAD_PROBE_SECONDS
                try:
                    _check_reachable(self.address)
                except ComputeUnavailable:
                    process.kill()
            if not process.is_alive():
                self._stop_driver()
                raise ComputeUnavailable(self._lost())

    def _send(self, message: tuple[Any, ...]) -> None:
        assert self._driver is not None
        try:
            self._driver[1].send(message)
        except OSError:
            self._stop_driver()
            raise ComputeUnavailable(self._lost()) from None

    def _ordered(self, fn: Callable[[object], bytes], slices: Sequence[object],
                 cancel: threading.Event | None) -> Iterator[bytes]:
        with self._lock:
            if self._closing.is_set():
                raise CancelledError("the pool is closing")
            self._connected()
            upcoming = iter(slices)
            self.sent = 0
            try:
                self._send(("call", fn))
                for part in islice(upcoming, self.in_flight):
                    self._send(("slice", part))
                    self.sent += 1
                for _ in range(len(slices)):
                    kind, value = self._recv(cancel)
                    if kind == "bad point":
                        raise ValueError(value)
                    if kind != "result":
                        raise ComputeUnavailable(f"PSI on the Ray cluster at {self.address} failed: {value}; the "
                                                 "session is aborted: run the alignment again once the cluster is "
                                                 "whole")
                    nxt = next(upcoming, None)
                    if nxt is not None:
                        self._send(("slice", nxt))
                        self.sent += 1
                    yield value
            finally:
                self._end_call()

    def _end_call(self) -> None:
        """Tell the driver the call is over (it cancels what is left) and read until it says done."""
        if self._driver is None:
            return
        try:
            self._driver[1].send(("end",))
            while self._driver[1].poll(30):
                if self._driver[1].recv()[0] == "done":
                    return
        except (EOFError, OSError):
            pass
        self._stop_driver()  # no answer: a driver in an unknown state is not reused

    def _stop_driver(self) -> None:
        if self._driver is None:
            return
        process, conn = self._driver
        self._driver = None
        try:
            conn.send(("close",))
        except OSError:
            pass
        process.join(10)
        if process.is_alive():
            process.kill()
            process.join(5)
        conn.close()

    def start(self) -> None:
        with self._lock:
            self._connected()

    def close(self) -> None:
        """Stop the call under way (``CancelledError``) and the driver; the cluster keeps running for its other
        users. A closed pool starts again on its next call."""
        self._closing.set()
        with self._lock:
            self._stop_driver()
            self._closing.clear()

"""Run the curve math on every core, here or on the party's own Ray cluster.

Hashing and blinding are embarrassingly parallel over fixed-width records, so
a batch is cut into slices, each slice goes to a worker, and the results are
joined in order. Small batches run inline: starting workers costs more than it
saves.

``WorkerPool`` (the default) runs worker processes on this machine, from a
``forkserver`` context: forking a process that runs an event loop and threads
(a party service) can deadlock the child. ``RayPool`` (``alignment.ray_pool``,
``--ray-address``) runs the same slices as Ray tasks; ``make_pool`` picks one.
Both go through ``SlicePool``, so they cut, order, cancel and name a bad point
alike, and give the same bytes.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.forkserver
import os
import select
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import CancelledError, Executor, Future, ProcessPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeout
from functools import partial
from itertools import islice

from alignment import curve
from alignment.spool import Permuted, Spool

__all__ = ["SlicePool", "WorkerPool", "make_pool", "start_fork_server"]

logger = logging.getLogger(__name__)

#: Below this many records, work runs in the calling process.
INLINE_BELOW = 8192
SLICE_RECORDS = 8192


def start_fork_server(workers: int | None) -> None:
    """Start the fork server every worker pool of this process forks from, deaf to Ctrl-C.

    Ctrl-C reaches every process of the terminal's group, and the service that owns the
    pools stops them itself. The fork server is a fresh interpreter that would print a
    traceback if the signal came while it starts; it is started here with SIGINT ignored,
    which it keeps and its workers inherit. Call it from the main thread, before serving;
    with one worker (everything runs inline) there is nothing to start.
    """
    if not WorkerPool(workers).parallel:
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        signal.signal(signal.SIGINT, previous)


def _worker_init(owner: int) -> None:
    """Ignore Ctrl-C, and exit when ``owner`` (the process whose pool this is) exits, however it ends.

    Ctrl-C goes to every process in the terminal's group; the service that owns the pool shuts it
    down, so a worker has nothing to do with the signal but print a traceback. But an owner killed
    outright (SIGKILL, the OOM killer) shuts nothing down: its workers, forked by the fork server, wait on
    a queue they hold both ends of, and keep the fork server and the resource tracker alive with them.
    So each worker watches its owner and follows it.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_with, args=(owner,), daemon=True, name="owner-watch").start()


def _exit_with(owner: int) -> None:
    try:
        handle = os.pidfd_open(owner)  # Linux: readable the moment the owner exits
    except (AttributeError, OSError):
        handle = None
    if handle is not None:
        select.select([handle], [], [])
    else:
        while True:
            time.sleep(1.0)
            try:
                os.kill(owner, 0)
            except ProcessLookupError:
                break
            except PermissionError:  # alive, and another user's: cannot be ours, but keep watching
                continue
    os._exit(0)


def _hash_slice(ids: Sequence[bytes], dst: bytes) -> bytes:
    return curve.hash_to_curve(ids, dst)


def make_pool(workers: int | None = None, ray_address: str | None = None) -> SlicePool:
    """The pool a party's settings ask for: Ray tasks on the cluster at ``ray_address``, else local processes."""
    if ray_address:
        from alignment.ray_pool import RayPool

        return RayPool(ray_address, workers)
    return WorkerPool(workers)


class Slices(Sequence[object]):
    """``records`` cut into slices of ``size`` records of ``width`` items each (``width`` bytes of a blob of
    points; 1: an ID of a sequence), each slice made only when it is reached: a pool that keeps a few in
    flight never holds the set twice. A sequence of no records has one empty slice."""

    def __init__(self, records: Sequence[object] | bytes, size: int, width: int = 1) -> None:
        self.records, self.step = records, size * width
        self.count = max(1, -(-len(records) // self.step))

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> object:  # type: ignore[override]
        if not 0 <= index < self.count:
            raise IndexError("slice index out of range")
        part = self.records[index * self.step : (index + 1) * self.step]
        return bytes(part) if isinstance(part, (bytearray, memoryview)) else part  # what a worker is sent


def _gather(parts: Iterator[bytes], total: int, into: Spool | None = None) -> bytearray | Spool:
    """Parts laid end to end, in one buffer allocated once (never the parts and their join at once) or
    appended to ``into``, a set on disk."""
    out = bytearray(0 if into is not None else total)
    at = 0
    for part in parts:
        if into is not None:
            into.write(part)
        else:
            out[at : at + len(part)] = part
        at += len(part)
    if at != total:
        raise RuntimeError(f"the workers returned {at} bytes; {total} were expected")
    return into if into is not None else out


class SlicePool:
    """Hashing and blinding cut into slices that run somewhere (``_ordered``), joined in order."""

    workers: int

    def _ordered(self, fn: Callable[[object], bytes], slices: Sequence[object],
                 cancel: threading.Event | None) -> Iterator[bytes]:
        """``fn`` of every slice, in order, run in parallel; ``cancel`` set stops it (``CancelledError``)."""
        raise NotImplementedError

    @property
    def parallel(self) -> bool:
        """Whether this pool runs anything off the calling thread."""
        return self.workers > 1

    def _parallel(self, n: int) -> bool:
        return self.parallel and n >= INLINE_BELOW

    def hash_to_curve(self, ids: Sequence[bytes], dst: bytes = curve.DEFAULT_DST, *,
                      into: Spool | None = None) -> bytes | Spool:
        """``curve.hash_to_curve`` over all workers; ``into``: write the points there (and return it)."""
        if not self._parallel(len(ids)):  # slice by slice still: a whole set at once holds ~1.5 KB an ID meanwhile
            parts: Iterator[bytes] = (curve.hash_to_curve(part, dst) for part in Slices(ids, SLICE_RECORDS))  # type: ignore[arg-type]
        else:
            parts = self._ordered(partial(_hash_slice, dst=dst), Slices(ids, SLICE_RECORDS), None)  # type: ignore[arg-type]
        return _gather(parts, len(ids) * curve.POINT_BYTES, into)

    def blind(self, key: bytes, points: bytes | Spool | Permuted, out_bytes: int = curve.POINT_BYTES,
              cancel: threading.Event | None = None, *, validate: bool = True,
              into: Spool | None = None) -> bytes | Spool:
        """``curve.blind`` over all workers; ``cancel`` set stops it between slices (``CancelledError``).

        ``points``: bytes, or anything read like bytes by slice (``alignment.spool``). ``validate``: check
        every point first (``curve.check_points``); only a party's own freshly hashed points skip it. A bad
        point is named by the slice it is in and its place there. ``into``: write the results there (and
        return it) instead of in memory.
        """
        n = len(points) // curve.POINT_BYTES
        slices = Slices(points, SLICE_RECORDS, curve.POINT_BYTES)
        fn: Callable[[bytes], bytes] = partial(curve.blind, key, out_bytes=out_bytes, validate=validate)
        parallel = self._parallel(n)
        results = self._ordered(fn, slices, cancel) if parallel else self._inline(fn, slices, cancel)  # type: ignore[arg-type]

        def named() -> Iterator[bytes]:
            for i in range(len(slices)):
                try:
                    yield next(results)
                except ValueError as exc:
                    raise ValueError(f"{exc} (in the slice from point {i * SLICE_RECORDS})") from exc

        return _gather(named(), n * out_bytes, into)

    @staticmethod
    def _inline(fn: Callable[[bytes], bytes], slices: Sequence[bytes],
                cancel: threading.Event | None) -> Iterator[bytes]:
        for part in slices:
            if cancel is not None and cancel.is_set():
                raise CancelledError("blinding cancelled")
            yield fn(part)

    def start(self) -> None:
        """Start the workers now, so the first session does not wait for them (a no-op inline)."""

    def close(self) -> None:
        """Stop the workers; a pool closed can start again."""

    def __enter__(self) -> SlicePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class WorkerPool(SlicePool):
    """A lazily started pool of worker processes on this machine."""

    def __init__(self, workers: int | None = None) -> None:
        self.workers = workers if workers is not None else (os.cpu_count() or 1)
        self._executor: Executor | None = None

    def _pool(self) -> Executor:
        if self._executor is None:
            ctx = multiprocessing.get_context("forkserver")
            self._executor = ProcessPoolExecutor(
                max_workers=self.workers, mp_context=ctx, initializer=_worker_init, initargs=(os.getpid(),)
            )
            logger.info("started %d PSI worker processes", self.workers)
        return self._executor

    def _ordered(self, fn: Callable[[object], bytes], slices: Sequence[object],
                 cancel: threading.Event | None) -> Iterator[bytes]:
        upcoming = iter(slices)
        futures = deque(self._pool().submit(fn, part) for part in islice(upcoming, 2 * self.workers))
        try:
            while futures:
                result = self._result(futures[0], cancel)
                futures.popleft()
                part = next(upcoming, None)
                if part is not None:  # one in, one out: a few slices in flight, never the whole set
                    futures.append(self._pool().submit(fn, part))
                yield result
        finally:
            for future in futures:  # whatever has not started never will
                future.cancel()

    @staticmethod
    def _result(future: Future[bytes], cancel: threading.Event | None) -> bytes:
        while True:
            if cancel is not None and cancel.is_set():
                raise CancelledError("blinding cancelled")
            try:
                return future.result(timeout=0.2)
            except FuturesTimeout:
                continue

    def start(self) -> None:
        """Start the worker processes now, so the first session does not wait for them (a no-op inline)."""
        if self.parallel:
            for future in [self._pool().submit(os.getpid) for _ in range(self.workers)]:
                future.result()

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None

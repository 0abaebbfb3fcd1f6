"""PSI hashing and blinding as Ray tasks on the party's own cluster (``--ray-address``).

A party past one machine runs its curve math on a Ray cluster it already has
(``ray start --head`` on one node, ``ray start --address HEAD:6379`` on the
others, cutlayer with its ``ray`` extra installed on every node). The slices are
those of the local pool (``alignment.parallel``) and the functions the same, so
the bytes are the same; only where they run changes.

What the cluster sees: this party's own IDs and its PSI session keys. It must
be the party's own, inside its own network; nothing of it is shared with a peer,
and no peer ever talks to it.

Back-pressure: at most ``in_flight`` slices (twice the cluster's CPUs, or the
``workers`` asked for) are submitted and not yet collected, and results are
collected in order, so the pool never holds more than that many slices'
results however slow the caller that consumes them.

Failures: tasks are not retried. A cluster that cannot be reached, a node or a
worker that dies, or a node running other code raises ``ComputeUnavailable``,
which aborts the PSI session (the peer is told, nothing is committed); the
alignment can be run again once the cluster is whole.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import CancelledError
from typing import Any

from alignment import curve
from alignment.parallel import SlicePool
from parties.errors import ComputeUnavailable, ConfigError

__all__ = ["RayPool"]

logger = logging.getLogger(__name__)

#: Seconds to wait for a TCP connection to the head before calling the cluster unreachable.
CONNECT_SECONDS = 5.0

# Ray joins a process to one cluster: the pools of one process (a bank's and a partner's in a test) share it,
# and the last to close leaves it.
_joined: dict[str, Any] = {"address": None, "pools": 0}
_joined_lock = threading.Lock()


def _run(fn: Callable[[object], bytes], part: object) -> bytes:
    return fn(part)


def _code_version() -> tuple[str, str]:
    """What a node runs: the curve's DST prefix and the installed cutlayer version."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        installed = version("cutlayer")
    except PackageNotFoundError:
        installed = "not installed"
    return curve.DST_PREFIX.decode(), installed


def _import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise ConfigError("--ray-address needs Ray: pip install 'cutlayer[ray]' on this machine and on every node "
                          "of the cluster") from exc
    return ray


def _check_reachable(address: str) -> None:
    """Refuse at once, with the reason, an address whose head does not answer (Ray itself waits a minute)."""
    host, _, port = address.rpartition(":")
    if address == "auto" or not host:
        return
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_SECONDS):
            pass
    except ValueError as exc:
        raise ConfigError(f"--ray-address {address!r} is not HOST:PORT or 'auto'") from exc
    except OSError as exc:
        raise ComputeUnavailable(f"the Ray cluster at {address} cannot be reached: {exc}") from exc


class RayPool(SlicePool):
    """``SlicePool`` on a Ray cluster; connects on first use (or ``start``)."""

    def __init__(self, address: str, workers: int | None = None) -> None:
        self.address = address
        self._asked = workers
        self.workers = workers or 2  # until connected: anything above 1 sends big batches to the cluster
        self.in_flight = 2 * self.workers
        self._task: Any = None
        self._lock = threading.Lock()

    def _connect(self) -> Any:
        with self._lock:
            ray = _import_ray()
            if self._task is not None and ray.is_initialized():
                return ray
            self._join(ray)
            try:
                cpus = int(ray.cluster_resources().get("CPU", 0))
            except (ConnectionError, RuntimeError) as exc:
                raise ComputeUnavailable(f"the Ray cluster at {self.address} does not answer: {exc}") from exc
            if cpus < 1:
                raise ComputeUnavailable(f"the Ray cluster at {self.address} has no CPUs to run PSI on")
            self.workers = self._asked or cpus
            self.in_flight = 2 * self.workers
            task = ray.remote(num_cpus=1, max_retries=0)(_run)
            self._check_nodes(ray)
            self._task = task
            logger.info("PSI runs on the Ray cluster at %s: %d CPUs, %d slices in flight at most",
                        self.address, cpus, self.in_flight)
            return ray

    def _join(self, ray: Any) -> None:
        with _joined_lock:
            if _joined["pools"] and ray.is_initialized():
                if _joined["address"] != self.address:
                    raise ConfigError(f"this process already runs PSI on the Ray cluster at {_joined['address']}; "
                                      f"it cannot join {self.address} too")
            else:
                _check_reachable(self.address)
                try:
                    ray.init(address=self.address, namespace="cutlayer-psi", log_to_driver=False,
                             logging_level=logging.WARNING, configure_logging=False, ignore_reinit_error=True)
                except (ConnectionError, RuntimeError, ValueError) as exc:
                    raise ComputeUnavailable(f"could not join the Ray cluster at {self.address}: {exc}") from exc
                _joined["address"], _joined["pools"] = self.address, 0
            _joined["pools"] += 1

    def _check_nodes(self, ray: Any) -> None:
        """Every node that runs our slices must run our code: a node on another version would hash differently."""
        here = _code_version()
        probe = ray.remote(num_cpus=1, max_retries=0)(_code_version)
        nodes = [n["NodeID"] for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get("CPU")]
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        refs = [probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()
                for node in nodes]
        try:
            seen = ray.get(refs, timeout=120)
        except ray.exceptions.RayError as exc:
            raise ComputeUnavailable(f"a node of the Ray cluster at {self.address} did not answer: {exc}") from exc
        for node, theirs in zip(nodes, seen):
            if tuple(theirs) != here:
                raise ComputeUnavailable(
                    f"Ray node {node[:12]} runs cutlayer {theirs[1]} (PSI {theirs[0]}); this party runs {here[1]} "
                    f"(PSI {here[0]}): install the same version on every node")

    def _ordered(self, fn: Callable[[object], bytes], slices: Sequence[object],
                 cancel: threading.Event | None) -> Iterator[bytes]:
        ray = self._connect()
        pending: deque[Any] = deque()
        fn_ref = ray.put(fn)  # the key and the DST travel once, not once a slice
        upcoming = iter(slices)
        try:
            for part in upcoming:
                pending.append(self._task.remote(fn_ref, part))
                if len(pending) >= self.in_flight:
                    yield self._result(ray, pending.popleft(), cancel)
            while pending:
                yield self._result(ray, pending.popleft(), cancel)
        finally:
            for ref in pending:  # not collected: stop what has not finished
                ray.cancel(ref, force=False)

    def _result(self, ray: Any, ref: Any, cancel: threading.Event | None) -> bytes:
        while True:
            if cancel is not None and cancel.is_set():
                raise CancelledError("blinding cancelled")
            ready, _ = ray.wait([ref], timeout=0.2)
            if ready:
                break
        try:
            return ray.get(ref)
        except ray.exceptions.RayTaskError as exc:
            cause = exc.cause
            if isinstance(cause, ValueError):  # a bad point from the peer: the caller names it
                raise ValueError(str(cause)) from None
            raise ComputeUnavailable(f"a PSI task failed on the Ray cluster at {self.address}: {cause!r}") from exc
        except ray.exceptions.RayError as exc:
            raise ComputeUnavailable(
                f"the Ray cluster at {self.address} lost a PSI task ({type(exc).__name__}: a node or worker died); "
                "the session is aborted: run the alignment again once the cluster is whole") from exc

    def start(self) -> None:
        self._connect()

    def close(self) -> None:
        """Leave the cluster; it keeps running for its other users."""
        with self._lock, _joined_lock:
            if self._task is None:
                return
            self._task = None
            _joined["pools"] -= 1
            if _joined["pools"] == 0:
                _import_ray().shutdown()

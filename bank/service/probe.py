"""The operator's partner check: is each partner up and ready, and which certificate does it answer with?
Bounded whatever a partner does: a deadline for all of them, a cap on what is read, one probe per partner."""

from __future__ import annotations

import json
import threading
import time

from bank.settings import BankSettings
from parties.errors import CutlayerError
from parties.protocol.common import READY
from parties.protocol.control import PartnerList, PartnerStatus
from parties.transport.client import client_for, peer_certificate, server_identity
from parties.transport.tls import handshake_failure

__all__ = ["PROBE_BYTES", "PROBE_SECONDS", "PartnerProbes", "probe_partner"]

#: How long the operator's partner check waits for each partner, all told (seconds); the most of its answer read.
PROBE_SECONDS = 5.0
PROBE_BYTES = 4096


def probe_partner(settings: BankSettings, name: str, url: str) -> PartnerStatus:
    """Ask a partner whether it is ready, and read the certificate it answered with: within ``PROBE_SECONDS``
    all told (a partner that answers a byte at a time is cut off), reading at most ``PROBE_BYTES``."""
    client = client_for(settings, timeout=PROBE_SECONDS)
    expired = threading.Event()

    def cut_off() -> None:  # closing the client ends a read that drags on
        expired.set()
        client.close()

    deadline = threading.Timer(PROBE_SECONDS, cut_off)
    deadline.start()
    try:
        with client.stream("GET", url.rstrip("/") + READY) as response:
            identity = server_identity(response)  # raises PeerUntrusted: a certificate this bank does not trust
            certificate = peer_certificate(response)
            body = b""
            for chunk in response.iter_raw():
                body += chunk
                if len(body) >= PROBE_BYTES:
                    break
    except CutlayerError as exc:
        return PartnerStatus(name=name, url=url, reachable=False, problem=_short(str(exc)))
    except Exception as exc:  # noqa: BLE001 (httpx's errors, or a read the deadline cut: all say it did not answer)
        if expired.is_set():
            why = f"it did not answer within {PROBE_SECONDS:.0f} s"
        else:
            why = handshake_failure(exc) or f"it did not answer ({type(exc).__name__}: {exc})"
        return PartnerStatus(name=name, url=url, reachable=False, problem=_short(why))
    finally:
        deadline.cancel()
        client.close()
    problem = None
    if identity is not None and (identity.name, identity.role) != (name, "partner"):
        problem = f"its certificate names {identity.role} {identity.name!r}, not partner {name!r}"
    elif response.status_code != 200:
        problem = f"not ready (HTTP {response.status_code})" + _problems(body)
    return PartnerStatus(name=name, url=url, reachable=True, ready=response.status_code == 200,
                         certificate=certificate, problem=_short(problem) if problem else None)


def _problems(body: bytes) -> str:
    """What a partner's /ready says is wrong, if it says it as its service does (a JSON list of words)."""
    try:
        problems = json.loads(body).get("problems")
    except (ValueError, AttributeError, RecursionError):  # RecursionError: "[" * 4000
        return ""
    if not isinstance(problems, list) or not all(isinstance(p, str) for p in problems):
        return ""
    return ": " + "; ".join(problems[:3]) if problems else ""


def _short(text: str, most: int = 300) -> str:
    return text if len(text) <= most else text[: most - 1] + "…"


class PartnerProbes:
    """The bank's partner checks. Per partner, its latest probe: a partner that never lets its probe end holds one
    thread, not one a call."""

    def __init__(self, settings: BankSettings) -> None:
        self.settings = settings
        self._lock = threading.Lock()
        self._probes: dict[str, tuple[threading.Thread, list[PartnerStatus]]] = {}

    def status(self) -> PartnerList:
        """Each configured partner, probed now, all at once: does it answer, as the partner its certificate must
        name? Answers within ``PROBE_SECONDS`` whatever a partner does: a probe still running then is reported
        as not answering, and one of a partner at a time runs (a caller meanwhile shares it)."""
        deadline = time.monotonic() + PROBE_SECONDS
        probes = {name: self._probe(name, url) for name, url in self.settings.partners.items()}
        found = []
        for name, (thread, answer) in probes.items():
            thread.join(max(0.0, deadline - time.monotonic()))
            found.append(answer[0] if answer else PartnerStatus(
                name=name, url=self.settings.partners[name], reachable=False,
                problem=f"it did not answer within {PROBE_SECONDS:.0f} s"))
        return PartnerList(partners=found)

    def _probe(self, name: str, url: str) -> tuple[threading.Thread, list[PartnerStatus]]:
        """The probe of ``name`` running now, else a new one: a thread, and the list its answer goes into."""
        with self._lock:
            running = self._probes.get(name)
            if running is not None and running[0].is_alive():
                return running
            answer: list[PartnerStatus] = []
            thread = threading.Thread(target=lambda: answer.append(probe_partner(self.settings, name, url)),
                                      name=f"probe-{name}", daemon=True)
            thread.start()
            self._probes[name] = (thread, answer)
            return thread, answer

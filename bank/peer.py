"""The bank's link to one peer service: what every client of a partner, a compute party or a branch shares.

``bank.vertical.http_partner.HttpPartner`` (vertical: PSI, training, scoring) and
``bank.configurations.layer_peer.LayerPeer`` (the layer exchange) are both a ``PeerLink``. A link owns:

- **who answered**: the certificate's name and role (``expect_server``); a failed handshake is
  ``PeerUntrusted``, no answer at all ``PeerUnavailable``;
- **how much of an answer is read**: as it streams in, refused past the size it could honestly have (a
  refusal's past ``ERROR_BODY_LIMIT``) or past ``answer_deadline`` seconds, and never decompressed (a few
  hundred compressed bytes can decode to gigabytes before any size check): a peer cannot spend the bank's
  memory or time;
- **the counts**: round trips, bytes sent and received, retries (every answer counted once, whichever
  connection brought it);
- **one refusal map**: a peer's ``{"error": kind}`` raised as the ``parties.errors`` class of that name,
  for the kinds a caller acts on (``PASSED_ON``), else ``PeerError``; every refusal is a ``PeerError`` too, so
  code that handles any peer's failure (ending a session, say) handles them all;
- **one retry rule**: only an idempotent call is retried (``call``; ``once`` is not), only while the peer does
  not answer, under ``retry_policy``; a peer that has never answered is given ``FIRST_CONTACT_DEADLINE``
  seconds (a wrong URL or a service not started is said within seconds), one that has answered the
  whole ``retry_deadline`` (it may be restarting).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import NoReturn, TypeVar

import httpx
from tenacity import RetryCallState, Retrying, retry_if_exception_type, stop_before_delay, wait_exponential

from parties.errors import (
    AlignmentMismatch,
    BadMessage,
    Behind,
    CutlayerError,
    IntersectionTooSmall,
    NotReady,
    OutOfOrder,
    OverBudget,
    PeerError,
    PeerUnavailable,
    PeerUntrusted,
    QuotaExceeded,
    StorageError,
    UnknownSession,
)
from parties.transport.client import EXPECT, expect_server
from parties.transport.tls import PeerIdentity, handshake_failure

__all__ = ["ERROR_BODY_LIMIT", "FIRST_CONTACT_DEADLINE", "HEADER_ROOM", "JSON_LIMIT", "PASSED_ON", "PeerLink",
           "retry_policy"]

logger = logging.getLogger(__name__)
T = TypeVar("T")

#: The most a refusal's body may hold: the error and its reason.
ERROR_BODY_LIMIT = 1 << 16
#: The most a JSON answer may hold: a session's description, a list of sessions, a branch's column statistics.
JSON_LIMIT = 16 << 20
#: Room for a tensor message's header beside its tensors (``parties.protocol.wire.parse`` refuses a longer one).
HEADER_ROOM = 8 + (1 << 16)
#: Seconds a party that has never answered is retried before the bank says so (a wrong URL, a service not started).
FIRST_CONTACT_DEADLINE = 5.0
#: The refusals a caller acts on, by the ``error`` a peer names: raised as themselves, every other one as
#: ``PeerError``. ``NotReady`` (a PSI chunk not computed yet) and ``Behind`` (a restarted partner behind the
#: bank) are among them.
def _refused_as(kind: type[CutlayerError]) -> type[PeerError]:
    """``kind`` as a peer's refusal: caught as ``kind`` where the caller acts on it, and as ``PeerError`` where it
    handles any peer's failure. Its HTTP status and name are ``kind``'s."""
    doc = f"A peer's refusal: {kind.__doc__}"
    return type(kind.__name__, (kind, PeerError), {"__module__": __name__, "__doc__": doc})


PASSED_ON: dict[str, type[PeerError]] = {e.__name__: _refused_as(e) for e in (
    AlignmentMismatch, Behind, IntersectionTooSmall, NotReady, OutOfOrder, OverBudget, QuotaExceeded, StorageError,
    UnknownSession)}
#: Answers are read as sent: a compressed one is refused, never decoded (``PeerLink._read``).
IDENTITY = {"accept-encoding": "identity"}


def retry_policy(deadline: float, before_sleep: Callable[[RetryCallState], None] | None = None) -> Retrying:
    """The one retry policy for calls to a party that may be restarting.

    Only ``PeerUnavailable`` (no answer at all) is retried: every call the policy wraps is idempotent, so
    sending it again is safe. Backoff doubles from 50 ms to 2 s; no attempt starts after ``deadline`` seconds.
    """
    return Retrying(
        retry=retry_if_exception_type(PeerUnavailable),
        stop=stop_before_delay(deadline),
        wait=wait_exponential(multiplier=0.05, min=0.05, max=2.0),
        before_sleep=before_sleep,
        reraise=True,
    )


class PeerLink:
    """One peer service (``role``: its certificate's role) reached through ``client`` at ``url``."""

    def __init__(self, name: str, url: str, client: httpx.Client, role: str, *, retry_deadline: float = 60.0,
                 answer_deadline: float = 600.0, known: bool = False) -> None:
        """``known``: this peer has answered the bank before (a training after its alignment), so a first
        silence may be a restart too."""
        self.name, self.url, self.client, self.role = name, url.rstrip("/"), client, role
        self.retry_deadline = retry_deadline  # how long a silent peer that has answered before is retried
        self.answer_deadline = answer_deadline  # how long one answer may take to arrive in full
        self.answered = known  # whether this peer has ever answered (then a silence may be a restart)
        self.bytes_sent = self.bytes_received = self.round_trips = self.retries = 0
        # Told each retry of a silent peer, in words for the operator (a job's progress line).
        self.on_retry: Callable[[str], None] | None = None
        self._retry_told = 0  # the last ten seconds of an outage the operator was told of

    @property
    def who(self) -> str:
        return f"{self.role} {self.name!r}"

    # --- one exchange ---------------------------------------------------------------------------------------
    def unreachable(self, exc: httpx.HTTPError | OSError, what: str) -> PeerError:
        """The error for an exchange that got no answer: the handshake refused, or no answer at all."""
        untrusted = handshake_failure(exc) if isinstance(exc, httpx.HTTPError) else None
        if untrusted:
            return PeerUntrusted(f"{self.who} at {self.url} answered ({what}), but {untrusted}")
        return PeerUnavailable(f"{self.who} at {self.url} did not answer ({what}): {exc}")

    def once(self, method: str, path: str, what: str, limit: int = JSON_LIMIT, **kwargs: object) -> bytes:
        """One call, never resent; its answer's body, read up to ``limit`` bytes (a refusal's up to
        ``ERROR_BODY_LIMIT``); a refusal raised as its error."""
        try:
            request = self.client.build_request(method, f"{self.url}{path}",  # type: ignore[arg-type]
                                                extensions={EXPECT: PeerIdentity(self.name, self.role)}, **kwargs)
            request.headers.update(IDENTITY)
            response = self.client.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise self.unreachable(exc, what) from exc
        try:
            expect_server(response, self.name, self.role)  # a refusal from another service is not the peer's
            content = self._read(response, limit if response.is_success else ERROR_BODY_LIMIT, what)
        finally:
            response.close()
        return self.answer(response.status_code, len(request.content or b""), content, what)

    def _read(self, response: httpx.Response, limit: int, what: str) -> bytes:
        """The body as it streams in: refused once past ``limit`` bytes, or past ``answer_deadline`` seconds."""
        refusal = "" if response.is_success else f" refused {what} (HTTP {response.status_code}) and"
        declared = response.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise PeerError(f"{self.who}{refusal} announced {declared} bytes ({what}); no more than {limit} bytes "
                            "were expected")
        encoding = response.headers.get("content-encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):
            raise PeerError(f"{self.who}{refusal} sent its answer ({what}) {encoding}-encoded; answers are read as "
                            "sent (identity), never decompressed")
        deadline = time.monotonic() + self.answer_deadline
        parts, size = [], 0
        try:
            for part in response.iter_raw():
                size += len(part)
                if size > limit:
                    raise PeerError(f"{self.who}{refusal} sent more than {limit} bytes ({what})")
                if time.monotonic() > deadline:
                    raise PeerError(f"{self.who} did not finish its answer ({what}) in {self.answer_deadline:.0f}s")
                parts.append(part)
        except httpx.HTTPError as exc:
            raise PeerUnavailable(f"{self.who} at {self.url} broke off its answer ({what}): {exc}") from exc
        return b"".join(parts)

    def answer(self, status: int, sent: int, content: bytes, what: str) -> bytes:
        """Every answer, whichever connection brought it: counted once, and a refusal raised as its error."""
        self.round_trips += 1
        self.bytes_sent += sent
        self.bytes_received += len(content)
        self.answered = True
        if not 200 <= status < 300:
            self.refused(status, content, what)
        return content

    def refused(self, status: int, content: bytes, what: str) -> NoReturn:
        """A refusal raised as the error it names (``PASSED_ON``), else as ``PeerError``; with its reason."""
        try:
            body = json.loads(content)
            kind, detail = str(body.get("error")), str(body.get("detail"))[:2000]
        except (ValueError, AttributeError, RecursionError):  # not JSON, not an object, or nested to no end
            kind, detail = "", content[:200].decode(errors="replace")
        if kind == "NotReady":  # not a failure: the caller asks again
            raise PASSED_ON[kind](f"{self.who} is not ready: {detail}")
        if kind == "Behind":
            raise PASSED_ON[kind](f"{self.who} is behind: {detail}")
        raise PASSED_ON.get(kind, PeerError)(f"{self.who} refused {what} (HTTP {status}): {detail}")

    def decoded(self, parse: Callable[[], T], what: str) -> T:
        """``parse()`` of an answer, its failure (``BadMessage``, pydantic's or JSON's ``ValueError``) a
        ``PeerError`` naming the peer."""
        try:
            return parse()
        except (BadMessage, ValueError) as exc:
            raise PeerError(f"{self.who} sent an unusable answer ({what}): {exc}") from exc

    # --- retried ------------------------------------------------------------------------------------------------
    def retried(self, what: str, call: Callable[[], T]) -> T:
        """An idempotent ``call`` under the retry policy: for ``retry_deadline`` seconds if this peer has answered
        before (it may be restarting), for ``FIRST_CONTACT_DEADLINE`` if it never has (a wrong URL or port is
        said within seconds); then a message that names the peer."""
        deadline = self.retry_deadline if self.answered else min(self.retry_deadline, FIRST_CONTACT_DEADLINE)

        def note(state: RetryCallState) -> None:
            self.retries += 1
            logger.warning("%s did not answer (%s); retrying in %.2fs", self.who, what,
                           state.next_action.sleep if state.next_action else 0.0)
            # Told at the first retry of an outage, then every 10 s: the operator sees it, and not 20 lines of it.
            if self.on_retry is not None and (state.attempt_number == 1 or
                                              state.seconds_since_start // 10 > self._retry_told):
                self._retry_told = int(state.seconds_since_start // 10)
                self.on_retry(f"{self.who} is not answering ({what}): retrying for up to {deadline:.0f} s, "
                              f"{state.seconds_since_start:.0f} s so far")

        try:
            return retry_policy(deadline, note)(call)
        except PeerUnavailable as exc:
            hint = "" if self.answered else " (it never answered: is the URL right, and the service started?)"
            raise PeerUnavailable(f"{self.who} at {self.url} did not answer ({what}) for {deadline:.0f}s{hint}: "
                                  f"{exc.__cause__ or exc}") from exc

    def call(self, method: str, path: str, what: str, limit: int = JSON_LIMIT, **kwargs: object) -> bytes:
        """An idempotent call (the peer answers a repeat without acting twice), resent while there is no answer."""
        return self.retried(what, lambda: self.once(method, path, what, limit, **kwargs))

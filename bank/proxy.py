"""The bank's view of a partner: a proxy that speaks the party protocol over HTTP.

The coordinator only sees the ``PsiPeer`` contract; ``alignment.local`` has the
in-process implementation that the same contract tests run against.
"""

from __future__ import annotations

import logging
import time

import httpx
import numpy as np

from alignment.session import SessionInfo
from parties.client import expect_server
from parties.errors import AlignmentMismatch, IntersectionTooSmall, NotReady, PeerError
from parties.protocol import ALIGNMENT_HEADER, DIGEST_HEADER, OCTET_STREAM, AlignmentInfo, PsiOpenRequest, PsiOpenResponse

__all__ = ["HttpPartner"]

logger = logging.getLogger(__name__)

_PASSED_ON = {"IntersectionTooSmall": IntersectionTooSmall, "AlignmentMismatch": AlignmentMismatch}


class HttpPartner:
    """A partner service reached over (mutual-TLS) HTTP."""

    def __init__(self, name: str, url: str, client: httpx.Client, *, wait_deadline: float = 600.0) -> None:
        self.name, self.url, self.client = name, url.rstrip("/"), client
        self.wait_deadline = wait_deadline
        self.bytes_sent = 0
        self.bytes_received = 0

    def _call(self, method: str, path: str, what: str, **kwargs: object) -> httpx.Response:
        try:
            response = self.client.request(method, f"{self.url}{path}", **kwargs)  # type: ignore[arg-type]
        except httpx.HTTPError as exc:
            raise PeerError(f"partner {self.name!r} at {self.url} did not answer ({what}): {exc}") from exc
        self.bytes_sent += len(response.request.content or b"")
        self.bytes_received += len(response.content)
        if response.is_success:
            return response
        try:
            body = response.json()
            kind, detail = str(body.get("error")), str(body.get("detail"))
        except ValueError:
            kind, detail = "", response.text[:200]
        if kind == "NotReady":
            raise NotReady(detail)
        error = _PASSED_ON.get(kind, PeerError)
        raise error(f"partner {self.name!r} refused {what} (HTTP {response.status_code}): {detail}")

    def _get_when_ready(self, path: str, what: str) -> bytes:
        deadline = time.monotonic() + self.wait_deadline
        while True:
            try:
                return self._call("GET", path, what).content
            except NotReady:
                if time.monotonic() > deadline:
                    raise PeerError(f"partner {self.name!r} was not ready with {what} in {self.wait_deadline:.0f}s")

    def open(self, own_count: int, chunk_items: int) -> SessionInfo:
        body = PsiOpenRequest(count=own_count, chunk_items=chunk_items).model_dump()
        response = self._call("POST", "/psi/sessions", "opening a PSI session", json=body)
        expect_server(response, self.name, "partner")
        info = PsiOpenResponse.model_validate(response.json())
        return SessionInfo(info.session, info.count, info.chunk_items)

    def _put(self, path: str, data: bytes, what: str) -> None:
        self._call("PUT", path, what, content=data, headers={"content-type": OCTET_STREAM})

    def put_blinded(self, session_id: str, index: int, data: bytes) -> None:
        self._put(f"/psi/sessions/{session_id}/blinded/{index}", data, "blinded IDs")

    def get_blinded(self, session_id: str, index: int) -> bytes:
        return self._get_when_ready(f"/psi/sessions/{session_id}/blinded/{index}", "its blinded IDs")

    def put_reblinded(self, session_id: str, index: int, data: bytes) -> None:
        self._put(f"/psi/sessions/{session_id}/reblinded/{index}", data, "re-blinded IDs")

    def get_reblinded(self, session_id: str, index: int) -> bytes:
        return self._get_when_ready(f"/psi/sessions/{session_id}/reblinded/{index}", "the re-blinded IDs")

    def commit(self, session_id: str, alignment_id: str, positions: np.ndarray, digest: bytes) -> int:
        response = self._call(
            "POST",
            f"/psi/sessions/{session_id}/commit",
            "the alignment",
            content=positions.astype("<u4").tobytes(),
            headers={"content-type": OCTET_STREAM, DIGEST_HEADER: digest.hex(), ALIGNMENT_HEADER: alignment_id},
        )
        return AlignmentInfo.model_validate(response.json()).rows

    def abort(self, session_id: str) -> None:
        self._call("DELETE", f"/psi/sessions/{session_id}", "aborting the session")

"""Cutlayer's domain exceptions, in one place.

The tree::

    CutlayerError
    ├── ConfigError                 a flag, setting or certificate is wrong
    ├── DataError                   a party's own data file is unusable
    │   ├── DatasetUnavailable      the public dataset is neither cached nor downloadable
    │   └── LogTampered             a session log's hash chain is broken: a line edited, deleted or moved
    ├── StorageError                a party could not write its state (disk full, ...) -> 507
    │   └── QuotaExceeded           a bank would pass its disk quota at this party
    ├── ProtocolError               a peer sent something we refuse (HTTP 4xx)
    │   ├── BadMessage              malformed, wrong size, wrong shape         -> 400
    │   ├── PayloadTooLarge         body over the configured limit             -> 413
    │   ├── UnknownSession          no such session (or it expired)            -> 404
    │   └── OutOfOrder              a valid message at the wrong time          -> 409
    │       ├── NotAligned          training or resuming before any alignment  -> 409
    │       ├── NotReady            the answer is still being computed; retry  -> 409
    │       └── Behind              the party is behind (restored from a checkpoint) -> 409
    ├── Forbidden                   the caller's certificate lacks the role    -> 403
    │   └── HijackSuspected         the partner's monitor saw a hijacking bank -> 403
    ├── OverBudget                  the caller used up its PSI budget for now  -> 429
    ├── AlignmentError              private set intersection could not finish  -> 422
    │   ├── IntersectionTooSmall    empty, or under the configured minimum
    │   ├── IdTypeMismatch          the two sides' IDs are of different types (integer, text)
    │   └── AlignmentMismatch       the two sides computed different results
    ├── PeerError                   a peer failed, dropped or refused us       -> 502
    │   ├── PeerUnavailable         no answer at all (refused, reset, timed out): retry
    │   └── PeerUntrusted           the TLS handshake failed: a certificate not of this partnership
    └── ComputeUnavailable          this party's own Ray cluster failed under a job: rerun it -> 503

Core code raises these; the app factory (``parties.transport.app``) maps them to HTTP
status codes, and the CLIs print their message and exit non-zero.
"""

from __future__ import annotations

__all__ = [
    "AlignmentError",
    "AlignmentMismatch",
    "BadMessage",
    "Behind",
    "ComputeUnavailable",
    "ConfigError",
    "CutlayerError",
    "DataError",
    "DatasetUnavailable",
    "Forbidden",
    "HijackSuspected",
    "IdTypeMismatch",
    "IntersectionTooSmall",
    "LogTampered",
    "NotAligned",
    "NotReady",
    "OutOfOrder",
    "OverBudget",
    "PayloadTooLarge",
    "StorageError",
    "PeerError",
    "PeerUnavailable",
    "PeerUntrusted",
    "ProtocolError",
    "QuotaExceeded",
    "UnknownSession",
]


class CutlayerError(Exception):
    """Base of every error Cutlayer raises on purpose."""

    status_code = 500


class ConfigError(CutlayerError):
    status_code = 400


class DataError(CutlayerError):
    status_code = 422


class DatasetUnavailable(DataError):
    pass


class LogTampered(DataError):
    """A session log no longer verifies: the partnership's record of PSI sessions cannot be trusted."""


class StorageError(CutlayerError):
    """Training state could not be written: training stops at once, the last whole checkpoints stay."""

    status_code = 507


class QuotaExceeded(StorageError):
    """Writing would pass a bank's disk quota: refused before a byte is written, like a full disk."""


class ProtocolError(CutlayerError):
    status_code = 400


class BadMessage(ProtocolError):
    status_code = 400


class PayloadTooLarge(ProtocolError):
    status_code = 413


class UnknownSession(ProtocolError):
    status_code = 404


class OutOfOrder(ProtocolError):
    status_code = 409


class NotAligned(OutOfOrder):
    """Training needs the customers aligned first."""


class NotReady(OutOfOrder):
    pass


class Behind(OutOfOrder):
    """A step from the future: this party restarted from an earlier checkpoint."""

    def __init__(self, message: str, next_step: int | None = None) -> None:
        super().__init__(message)
        self.next_step = next_step


class Forbidden(CutlayerError):
    status_code = 403


class HijackSuspected(Forbidden):
    pass


class OverBudget(CutlayerError):
    status_code = 429


class AlignmentError(CutlayerError):
    status_code = 422


class IntersectionTooSmall(AlignmentError):
    pass


class IdTypeMismatch(AlignmentError):
    pass


class AlignmentMismatch(AlignmentError):
    pass


class PeerError(CutlayerError):
    status_code = 502


class ComputeUnavailable(CutlayerError):
    """This party's own compute failed under a job (its Ray cluster unreachable, a worker dead): the job is
    aborted, nothing of it kept, and it can be run again once the cluster is whole."""

    status_code = 503


class PeerUnavailable(PeerError):
    pass


class PeerUntrusted(PeerError):
    """The peer answered, but the TLS handshake failed: retrying will not help."""

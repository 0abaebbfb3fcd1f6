"""What every party shares, in four sub-packages and four small modules.

- ``parties.protocol``: the messages parties exchange, one module per exchange, and the wire format.
- ``parties.transport``: services and clients: the app factory, uvicorn, mutual TLS, the hot path.
- ``parties.learning``: a party's bottom model in training and in scoring, embedding DP, the hijack monitor.
- ``parties.tables`` and ``parties.storage``: a party's own table and encoding; files and checkpoints.
- ``parties.errors`` and ``parties.speed`` (no dependencies: the switch and version gate of the speed code
  below public APIs), ``parties.settings``, ``parties.cli``.

Nothing is imported here: ``import parties.errors`` costs what that module costs, and no more.
"""

__all__: list[str] = []

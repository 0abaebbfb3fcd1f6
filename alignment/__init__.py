"""ECDH private set intersection on Curve25519: curve math, the protocol driver, the worker pool.

Needs neither FastAPI, pandas nor torch: a PSI worker process imports only ``alignment.curve``.
"""

__all__: list[str] = []

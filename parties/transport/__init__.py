"""Services and clients: the app factory, uvicorn with mutual TLS, the per-step hot path, jobs."""

__all__: list[str] = []

"""Reference models for a run, and single-process twins of every configuration. SIMULATION ONLY."""

__all__: list[str] = []

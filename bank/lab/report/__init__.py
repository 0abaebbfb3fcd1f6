"""A run's analysis: the report, the leakage audit, and the figures of the other configurations' runs."""

__all__: list[str] = []

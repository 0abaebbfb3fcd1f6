"""The bank's service: its HTTP edge, its state, the alignment with every partner, and the operator's client."""

__all__: list[str] = []

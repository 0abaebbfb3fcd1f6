"""Studies that measure what defenses, cuts and subset models cost and buy. SIMULATION ONLY."""

__all__: list[str] = []

"""Attacks a dishonest party could run: label inference, and hijacking banks. SIMULATION ONLY."""

__all__: list[str] = []

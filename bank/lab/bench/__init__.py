"""Benchmarks: split against unsplit training, across an emulated WAN, PSI, scale, the configurations."""

__all__: list[str] = []

"""Datasets and their vertical partitioning into per-party files."""

__all__: list[str] = []

"""What a party keeps on disk: whole files, private to it, and checkpoints."""

__all__: list[str] = []

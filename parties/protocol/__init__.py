"""What parties say to each other: one module per exchange, the wire format and HTTP framing."""

__all__: list[str] = []

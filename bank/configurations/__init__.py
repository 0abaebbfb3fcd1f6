"""The configurations beside vertical: U-shaped and vanilla, horizontal relay and SplitFed, their peer and runs."""

__all__: list[str] = []

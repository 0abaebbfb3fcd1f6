"""The vertical flow: the coordinator's step loop over every party, its recovery, defenses and the partner client."""

__all__: list[str] = []

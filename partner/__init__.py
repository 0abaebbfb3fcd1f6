"""The passive party: a service that holds features, no labels, and answers the bank."""

__all__: list[str] = []

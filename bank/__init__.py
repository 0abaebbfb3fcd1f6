"""The label holder: the training coordinator, its top model, its partners' proxies, the bank service.

Nothing is imported here; ``bank.lab`` holds the simulation and study tooling.
"""

__all__: list[str] = []

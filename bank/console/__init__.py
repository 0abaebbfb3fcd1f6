"""The bank operator's console: ``python -m bank console``, web pages over the bank service."""

__all__: list[str] = []

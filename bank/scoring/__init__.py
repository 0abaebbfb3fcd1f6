"""Scoring new customers with a trained model: the scorer, the subset and bank-only models, calibration, the manifest."""

__all__: list[str] = []

"""A party's model: its bottom in training and scoring, embedding DP, the hijack monitor, the fast path."""

__all__: list[str] = []

"""A party's own table: its schema, its customer IDs, and the encoding of its columns."""

__all__: list[str] = []

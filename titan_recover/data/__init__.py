"""Data: a prepared, tokenized corpus addressable by global microbatch id (see docs/data.md)."""

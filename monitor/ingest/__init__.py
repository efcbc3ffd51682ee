"""Ingest: the wire schemas and writing one validated batch, all or nothing."""

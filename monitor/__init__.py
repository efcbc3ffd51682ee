"""The runhealth service: store, ingest API, engine, decisions, exporters and CLI.

Runs without torch installed.
"""

__version__ = "0.1.0"

"""``runhealth``: the command line, one module per command group (``root.py`` registers them).

Listing commands take ``--json`` and print one document; a user error is one line on stderr."""

from monitor.cli.root import build_app, main

__all__ = ["build_app", "main"]

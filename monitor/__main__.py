"""``python -m monitor``: the ``runhealth`` command line."""

from monitor.cli import main

main()

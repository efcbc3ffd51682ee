"""Each test file's total seconds from a ``pytest --durations=0`` log, longest first, as the
``FILE_SECONDS`` entries of ``tests/scheduling.py`` (files of at least ``--min`` seconds).

    python scripts/file_seconds.py .tmp/durations.log [--min 15]
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from pathlib import Path

LINE = re.compile(r"^([0-9.]+)s (?:call|setup|teardown)\s+(tests/[^:]+\.py)::")


def file_seconds(text: str) -> Counter[str]:
    totals: Counter[str] = Counter()
    for line in text.splitlines():
        match = LINE.match(line.strip())
        if match:
            totals[match.group(2)] += float(match.group(1))
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("log", type=Path)
    parser.add_argument("--min", type=float, default=15.0, help="leave out files shorter than this")
    args = parser.parse_args()
    totals = file_seconds(args.log.read_text())
    for name, seconds in totals.most_common():
        if seconds >= args.min:
            print(f'    "{name}": {seconds:.1f},')
    print(f"# {sum(totals.values()):.0f} s in {len(totals)} files")


if __name__ == "__main__":
    main()

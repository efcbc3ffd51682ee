"""Regenerate the README's "Where each part lives" table from the module docstrings.

Every package and module under ``policies/``, ``collectors/`` and ``monitor/`` gets one row: its
path and the first sentence of its docstring. Rows for other paths (``migrations/``, ``deploy/``,
...) are written by hand and kept as they are. Run from the repository root:

    python scripts/where_parts_live.py           # rewrite the table in README.md
    python scripts/where_parts_live.py --check   # exit 1 when the table is not what this writes

``tests/test_readme_layout.py`` checks that every module is named in the table."""

from __future__ import annotations

import argparse
import ast
import re
import sys
from collections.abc import Iterator
from pathlib import Path

PACKAGES = ("policies", "collectors", "monitor")
SECTION = "## Where each part lives"
HEADER = ["| path | what |", "|---|---|"]
# A sentence ends at a period followed by a space and a capital letter (not after "e.g" or "i.e"),
# or at the paragraph's end.
SENTENCE_END = re.compile(r"(?<!e\.g)(?<!i\.e)(?<=\S)\.\s+(?=[A-Z`])")


def first_sentence(source: str) -> str:
    docstring = ast.get_docstring(ast.parse(source)) or ""
    paragraph = " ".join(docstring.strip().split("\n\n")[0].split())
    sentence = SENTENCE_END.split(paragraph, maxsplit=1)[0].rstrip(".")
    return sentence.replace("``", "`").replace("|", "\\|")


def module_rows(directory: Path, root: Path) -> Iterator[tuple[str, str]]:
    """The package's own row, then its modules, then its subpackages, each in name order."""
    init = directory / "__init__.py"
    yield f"{directory.relative_to(root).as_posix()}/", first_sentence(init.read_text())
    for module in sorted(directory.glob("*.py")):
        if module.name != "__init__.py":
            yield module.relative_to(root).as_posix(), first_sentence(module.read_text())
    for child in sorted(p for p in directory.iterdir() if (p / "__init__.py").is_file()):
        yield from module_rows(child, root)


def section_bounds(lines: list[str]) -> tuple[int, int]:
    """The table's first and past-last line in the README's section."""
    start = lines.index(SECTION)
    first = next(i for i in range(start, len(lines)) if lines[i].startswith("|"))
    last = next(i for i in range(first, len(lines)) if not lines[i].startswith("|"))
    return first, last


def hand_written_rows(table: list[str]) -> list[str]:
    """Rows of the current table for paths outside the three packages."""
    kept = []
    for row in table[len(HEADER) :]:
        path = row.split("|")[1].strip().strip("`")
        if path.split("/")[0] not in PACKAGES:
            kept.append(row)
    return kept


def render(readme: str, root: Path) -> str:
    lines = readme.split("\n")
    first, last = section_bounds(lines)
    rows = [
        f"| `{path}` | {what} |" for package in PACKAGES for path, what in module_rows(root / package, root)
    ]
    table = HEADER + rows + hand_written_rows(lines[first:last])
    return "\n".join(lines[:first] + table + lines[last:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 when stale")
    parser.add_argument("--root", type=Path, default=Path.cwd(), help="the repository root")
    args = parser.parse_args(argv)
    readme_path = args.root / "README.md"
    readme = readme_path.read_text()
    wanted = render(readme, args.root)
    if args.check:
        if wanted != readme:
            print(
                f"{readme_path}: the table is stale; run python scripts/where_parts_live.py", file=sys.stderr
            )
            return 1
        return 0
    readme_path.write_text(wanted)
    return 0


if __name__ == "__main__":
    sys.exit(main())

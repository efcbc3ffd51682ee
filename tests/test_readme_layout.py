"""The README's "Where each part lives" names every package and module of the three packages,
names none that does not exist, and says of each what its docstring says."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("policies", "collectors", "monitor")
SECTION = "## Where each part lives"
REGENERATE = "regenerate it: python scripts/where_parts_live.py"


def section_text() -> str:
    readme = (ROOT / "README.md").read_text()
    start = readme.index(SECTION)
    end = readme.find("\n## ", start + len(SECTION))
    return readme[start : end if end != -1 else len(readme)]


def named_paths() -> set[str]:
    """The first cell of every row of the section's table, without its backticks."""
    rows = [line for line in section_text().splitlines() if line.startswith("| `")]
    return {row.split("|")[1].strip().strip("`") for row in rows}


def modules_on_disk() -> set[str]:
    """Each package as ``dir/`` and each other module as its path."""
    found = set()
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if "__pycache__" in path.parts:
                continue
            relative = path.relative_to(ROOT)
            found.add(f"{relative.parent.as_posix()}/" if path.name == "__init__.py" else relative.as_posix())
    return found


def test_every_package_and_module_is_named() -> None:
    missing = modules_on_disk() - named_paths()
    assert not missing, f"not in the README's table: {sorted(missing)}; {REGENERATE}"


def test_every_named_module_exists() -> None:
    named = {path for path in named_paths() if path.split("/")[0] in PACKAGES}
    stale = named - modules_on_disk()
    assert not stale, f"in the README's table but not on disk: {sorted(stale)}; {REGENERATE}"


def test_each_row_says_what_the_docstring_says() -> None:
    checked = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "where_parts_live.py"), "--check", "--root", str(ROOT)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert checked.returncode == 0, checked.stderr

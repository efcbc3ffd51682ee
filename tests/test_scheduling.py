"""The suite's file order for its workers (``tests.scheduling``)."""

from __future__ import annotations

from pathlib import Path

from tests.scheduling import FILE_SECONDS, longest_first

ROOT = Path(__file__).resolve().parent.parent


def test_every_listed_file_exists() -> None:
    missing = [name for name in FILE_SECONDS if not (ROOT / name).is_file()]
    assert not missing, f"tests/scheduling.py lists files that are gone: {missing}"


class _Item:
    def __init__(self, path: Path, name: str) -> None:
        self.path, self.name = path, name


def test_longest_files_come_first_and_the_rest_keep_their_order() -> None:
    names = ["tests/test_api.py", "tests/test_db.py", "tests/test_attach_recipes.py", "tests/test_scheduling.py"]
    items = [_Item(ROOT / name, f"t{index}") for index, name in enumerate(names)]
    longest_first(items, ROOT)  # type: ignore[arg-type]
    assert [item.name for item in items] == ["t2", "t0", "t1", "t3"]


def test_the_makefile_keeps_xdist_from_reordering_files_by_test_count() -> None:
    makefile = (ROOT / "Makefile").read_text()
    assert "--dist loadfile" in makefile and "--no-loadscope-reorder" in makefile

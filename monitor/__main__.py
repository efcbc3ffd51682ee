"""``python -m monitor``: the ``runhealth`` command line."""

from __future__ import annotations

import os
import sys
from pathlib import Path

OWN_PACKAGES = ("monitor", "policies", "migrations")


def shadowing_packages(path: list[str], cwd: Path, own_root: Path) -> list[str]:
    """Folders of the working directory that are imported ahead of runhealth's own packages:
    ``python -m`` puts the working directory first on ``sys.path`` (not the ``runhealth``
    script, nor ``python -P``), so a trainer's ``policies/`` there would replace runhealth's."""
    if not path or Path(path[0] or ".").resolve() != cwd.resolve() or cwd.resolve() == own_root.resolve():
        return []
    return [name for name in OWN_PACKAGES if (cwd / name).is_dir()]


if __name__ == "__main__":
    shadowing = shadowing_packages(sys.path, Path(os.getcwd()), Path(__file__).resolve().parent.parent)
    if shadowing:
        print(
            f"runhealth: warning: {', '.join(f'{name}/' for name in shadowing)} in the working "
            f"directory {os.getcwd()} shadow runhealth's packages; run `runhealth` or "
            "`python -P -m monitor` instead",
            file=sys.stderr,
        )
    from monitor.cli import main

    main()

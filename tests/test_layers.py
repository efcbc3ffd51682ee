"""The import contracts in pyproject.toml (``[tool.importlinter]``), checked by the real
``lint-imports``: they hold for this tree, and each kind breaks when a forbidden import is added."""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.support import missing

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("policies", "collectors", "monitor")


def lint_imports() -> Path:
    """The venv's ``lint-imports``, beside this interpreter (CI fails rather than skips without it)."""
    found = Path(sys.executable).parent / "lint-imports"
    if not found.is_file():
        missing(f"lint-imports is not installed beside {sys.executable} (pip install import-linter)")
    return found


def run_contracts(root: Path) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` over the packages under ``root``, with that tree's pyproject.toml."""
    # The packages under root come first on the path, ahead of the editable install of this tree;
    # --no-cache keeps the tool from writing a cache into the tree it reads.
    environ = {**os.environ, "PYTHONPATH": str(root), "COLUMNS": "200"}  # one line per verdict
    return subprocess.run(
        [str(lint_imports()), "--config", str(root / "pyproject.toml"), "--no-cache"],
        cwd=root,
        env=environ,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_tree_keeps_every_contract() -> None:
    result = run_contracts(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.fixture
def tree_copy(tmp_path: Path) -> Path:
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


@pytest.mark.parametrize(
    ("module", "added", "contract"),
    [
        ("policies/spike.py", "monitor.store.models", "policies imports neither side"),
        ("policies/spike.py", "sqlalchemy", "policies is pure"),
        ("policies/protocol/kinds.py", "numpy", "the record protocol imports only the standard library"),
        ("collectors/spool.py", "monitor.store.floats", "collectors imports no service code"),
        ("monitor/judge/engine.py", "collectors.leftovers", "monitor imports no trainer code"),
        ("monitor/store/queries.py", "monitor.recovery.decisions", "monitor in layers"),
        ("monitor/cli/incidents.py", "monitor.cli.runs", "CLI command groups are independent"),
    ],
)
def test_a_forbidden_import_breaks_its_contract(
    tree_copy: Path, module: str, added: str, contract: str
) -> None:
    untouched = run_contracts(tree_copy)
    assert untouched.returncode == 0, untouched.stdout + untouched.stderr  # the copy is what is read
    source = tree_copy / module
    source.write_text(source.read_text() + f"\nimport {added}  # noqa: E402, F401\n")

    broken = run_contracts(tree_copy)

    assert broken.returncode == 1, broken.stdout + broken.stderr
    importer = module.removesuffix(".py").replace("/", ".")
    assert f"{importer} -> {added}" in broken.stdout
    verdicts = [line for line in broken.stdout.splitlines() if line.startswith(contract)]
    assert verdicts and "BROKEN" in verdicts[0].split(), broken.stdout


def runtime_dependencies() -> list[str]:
    """The distributions pyproject.toml names for the service and the trainer extras (not dev)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = [r for extra, reqs in project["optional-dependencies"].items() if extra != "dev" for r in reqs]
    return sorted({re.split(r"[\s<>=!~\[;]", req, maxsplit=1)[0] for req in project["dependencies"] + extras})


def import_names(distribution: str) -> set[str]:
    def canonical(name: str) -> str:
        return re.sub(r"[-_.]+", "-", name).lower()

    return {
        module
        for module, owners in importlib.metadata.packages_distributions().items()
        if canonical(distribution) in {canonical(owner) for owner in owners}
    }


@pytest.mark.parametrize(
    ("contract", "allowed"),
    [("policies is pure", {"numpy"}), ("the record protocol imports only the standard library", set())],
)
def test_the_purity_contracts_name_every_runtime_dependency(contract: str, allowed: set[str]) -> None:
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    forbidden = set(next(c for c in contracts if c["name"].startswith(contract))["forbidden_modules"])
    unnamed = {
        distribution: sorted(names)
        for distribution in runtime_dependencies()
        if not (names := import_names(distribution)) & (forbidden | allowed)
    }
    assert not unnamed, f"add to {contract!r} in pyproject.toml: {unnamed}"

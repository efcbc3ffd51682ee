"""The lines a user adds to attach runhealth: each hooked test trainer against the same trainer
without the hook (``tests/trainers/``), as a table.

    python scripts/attach_lines.py          # the table
    python scripts/attach_lines.py --json   # one JSON document (tests/test_attach_recipes.py)

The two files are compared with difflib, line by line, on their code: blank lines, comments and
the module docstring are left out (none of them is code a user must write). A line whose code
changed (a call wrapped in ``rh.grad_norm(...)``) counts once, as added; indentation counts, so
a block re-indented under a new ``with`` would count whole. ``removed`` lines must each survive
inside an added one (a wrapped call); any other is ``unexplained``, a sign the two files drifted
apart in something besides the hook.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import io
import json
import sys
import tokenize
from dataclasses import asdict, dataclass
from pathlib import Path

TRAINERS = Path(__file__).resolve().parents[1] / "tests" / "trainers"


@dataclass(frozen=True)
class Pair:
    name: str
    plain: str
    hooked: str
    target: int
    """The most added lines the attach may take (issue 14's targets for the nanoGPT-style loop)."""


PAIRS = (
    Pair("nanoGPT-style loop: the hook and values", "nanogpt_plain.py", "nanogpt_values.py", 5),
    Pair("nanoGPT-style loop: + checkpoints, resume, rollback", "nanogpt_plain.py", "nanogpt_hooked.py", 10),
    Pair("transformers Trainer subclass (callback)", "hf_plain.py", "hf_hooked.py", 2),
    Pair("Lightning, manual optimization (callback)", "lightning_plain.py", "lightning_hooked.py", 2),
)


@dataclass(frozen=True)
class Count:
    name: str
    plain: str
    hooked: str
    plain_lines: int
    added: int
    removed: int
    target: int
    unexplained: list[str]
    added_lines: list[str]

    @property
    def within_target(self) -> bool:
        return self.added <= self.target and not self.unexplained


def code_lines(source: str) -> list[str]:
    """The file's lines of code: comments cut off, blank lines and the module docstring left out."""
    lines = source.splitlines()
    docstring = _docstring_lines(source)
    comments: dict[int, int] = {}  # line -> the column its comment starts at
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comments[token.start[0]] = token.start[1]
    kept = []
    for number, line in enumerate(lines, start=1):
        if number in docstring:
            continue
        code = line[: comments[number]] if number in comments else line
        if code.strip():
            kept.append(code.rstrip())
    return kept


def _docstring_lines(source: str) -> set[int]:
    body = ast.parse(source).body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        node = body[0]
        if isinstance(node.value.value, str) and node.end_lineno is not None:
            return set(range(node.lineno, node.end_lineno + 1))
    return set()


def count(pair: Pair, directory: Path = TRAINERS) -> Count:
    plain = code_lines((directory / pair.plain).read_text())
    hooked = code_lines((directory / pair.hooked).read_text())
    added: list[str] = []
    removed: list[str] = []
    matcher = difflib.SequenceMatcher(a=plain, b=hooked, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag in ("insert", "replace"):
            added += hooked[j1:j2]
        if tag in ("delete", "replace"):
            removed += plain[i1:i2]
    unexplained = [line for line in removed if not any(line.strip() in new for new in added)]
    return Count(
        pair.name, pair.plain, pair.hooked, len(plain), len(added), len(removed), pair.target,
        unexplained, added,
    )  # fmt: skip


def table(counts: list[Count]) -> str:
    header = f"{'trainer':<52} {'plain':>5} {'added':>5} {'removed':>7} {'target':>6}  ok"
    rows = [
        f"{c.name:<52} {c.plain_lines:>5} {c.added:>5} {c.removed:>7} {c.target:>6}  "
        f"{'yes' if c.within_target else 'NO'}"
        for c in counts
    ]
    details = [
        f"\n{c.hooked} against {c.plain}:\n" + "\n".join(f"  + {line.strip()}" for line in c.added_lines)
        for c in counts
    ]
    return "\n".join([header, *rows, *details])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    parser.add_argument("--dir", type=Path, default=TRAINERS, help="where the trainers are")
    args = parser.parse_args(argv)
    counts = [count(pair, args.dir) for pair in PAIRS]
    if args.json:
        print(json.dumps([{**asdict(c), "within_target": c.within_target} for c in counts], indent=2))
    else:
        print(table(counts))
    return 0 if all(c.within_target for c in counts) else 1


if __name__ == "__main__":
    sys.exit(main())

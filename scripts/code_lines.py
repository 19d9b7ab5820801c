"""The package's code lines: lines that hold a code token, not counting docstrings, comments or blank lines (the
measure of the package's size budget).

    python scripts/code_lines.py              # the total for hetero_spec/
    python scripts/code_lines.py -v [PATH...] # per file, largest first, then the total
"""

from __future__ import annotations

import ast
import io
import sys
import tokenize
from pathlib import Path

NOT_CODE = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING,
            tokenize.ENDMARKER}


def code_lines(path: Path) -> int:
    source = path.read_text()
    docstrings = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            docstrings.update(range(node.lineno, node.end_lineno + 1))
    lines = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in NOT_CODE:
            lines.update(n for n in range(token.start[0], token.end[0] + 1) if n not in docstrings)
    return len(lines)


def main(argv: list[str]) -> int:
    verbose = "-v" in argv
    roots = [Path(a) for a in argv if a != "-v"] or [Path(__file__).resolve().parents[1] / "hetero_spec"]
    files = [f for root in roots for f in (sorted(root.rglob("*.py")) if root.is_dir() else [root])]
    counts = sorted(((code_lines(f), f) for f in files), reverse=True)
    if verbose:
        for count, path in counts:
            print(f"{count:6d} {path}")
    print(sum(count for count, _ in counts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

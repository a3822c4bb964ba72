"""Print the row-independence analysis's rule table as the Markdown docs/batching.md holds.

    python tools/batching_rules.py            # the table
    python tools/batching_rules.py --write    # replace the table in docs/batching.md

``tests/pool/test_rows.py`` fails when the docs' table is not this script's output.
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

from sharedml.rows import rules_table

DOCS = Path(__file__).resolve().parents[1] / "docs" / "batching.md"
BEGIN = "<!-- rule table: tools/batching_rules.py --write -->"
END = "<!-- end of rule table -->"


def table() -> str:
    lines = ["| domain | operators | rule |", "| --- | --- | --- |"]
    groups = []
    by_rule = sorted(rules_table(), key=lambda r: (r[0], r[2], r[1]))
    for (domain, summary), group in itertools.groupby(by_rule, key=lambda r: (r[0], r[2])):
        groups.append((domain, sorted(op for _, op, _ in group), summary))
    groups.sort(key=lambda g: (g[0] != "ai.onnx", g[0], g[1][0]))
    for domain, ops, summary in groups:
        names = ", ".join(f"`{op}`" for op in ops)
        lines.append(f"| {domain} | {names} | {summary} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="update docs/batching.md")
    args = parser.parse_args()
    text = table()
    if not args.write:
        print(text, end="")
        return
    doc = DOCS.read_text()
    head, _, rest = doc.partition(BEGIN)
    _, _, tail = rest.partition(END)
    DOCS.write_text(f"{head}{BEGIN}\n{text}{END}{tail}")


if __name__ == "__main__":
    main()

"""Print the row-independence analysis's rule table as the Markdown docs/batching.md holds.

    python tools/batching_rules.py            # the table
    python tools/batching_rules.py --write    # replace the table in docs/batching.md

``tests/pool/test_rows.py`` fails when the docs' table is not this script's output.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from sharedml.rows import rule_entries

DOCS = Path(__file__).resolve().parents[1] / "docs" / "batching.md"
BEGIN = "<!-- rule table: tools/batching_rules.py --write -->"
END = "<!-- end of rule table -->"


def table() -> str:
    """The rule table: a row per rule and first opset, a rule's rows together, oldest first."""
    lines = ["| domain | operators | opsets | rule |", "| --- | --- | --- | --- |"]
    entries = rule_entries()
    first_op: dict[tuple[str, str], str] = {}
    for e in entries:  # sorted by operator: a rule's rows sort by its first operator
        first_op.setdefault((e.domain, e.summary), e.op_type)
    rows: dict[tuple[str, str, int], list[str]] = {}
    for e in entries:
        rows.setdefault((e.domain, e.summary, e.since), []).append(f"`{e.op_type}`")
    order = sorted(rows, key=lambda k: (k[0] != "ai.onnx", k[0], first_op[k[0], k[1]], k[2]))
    for domain, summary, since in order:
        names = ", ".join(rows[domain, summary, since])
        lines.append(f"| {domain} | {names} | opset >= {since} | {summary} |")
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

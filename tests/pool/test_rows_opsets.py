"""The row analysis's rules: one registration line per operator, and the opsets each covers.

A rule answers only for the versions of its operator it was written for: a node of an older opset
is refused whatever its inputs, naming the operator and both opsets.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import onnx.defs
import pytest
from onnx import ModelProto, TensorProto, helper

from sharedml.rows import RowAnalysis, rule_entries

F = TensorProto.FLOAT
SRC = Path(__file__).resolve().parents[2] / "src" / "sharedml" / "rows"


def _model(nodes: Sequence[Any], opsets: dict[str, int]) -> ModelProto:
    graph = helper.make_graph(
        list(nodes),
        "g",
        [helper.make_tensor_value_info("x", F, ["N", 4])],
        [helper.make_tensor_value_info("y", F, None)],
        initializer=[helper.make_tensor("w", F, [4], [1.0, 2.0, 3.0, 4.0])],
    )
    m = helper.make_model(
        graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets.items()]
    )
    m.ir_version = 8
    return m


def _refusal(m: ModelProto) -> str | None:
    found = RowAnalysis(m).refusal()
    return None if found is None else found.describe()


@pytest.mark.parametrize(
    ("op", "opset", "since"),
    [
        ("Gelu", 17, 20),  # ai.onnx has no Gelu before opset 20
        ("Add", 6, 7),  # Add-6 broadcast B from the axis an attribute named
    ],
)
def test_a_node_older_than_its_rule_is_refused_naming_the_operator_and_both_opsets(
    op: str, opset: int, since: int
) -> None:
    inputs = ["x"] if op == "Gelu" else ["x", "w"]
    m = _model([helper.make_node(op, inputs, ["y"], name="n")], {"": opset})
    assert _refusal(m) == (
        f"node 'n' ({op}) (on the rows of input 'x') is {op} of ai.onnx opset {opset}, older "
        f"than the analysis knows it: its rule covers opset {since} and later"
    )
    m.opset_import[0].version = since  # the same node from its rule's first opset: proven
    assert _refusal(m) is None


def test_an_older_node_is_refused_even_where_no_row_reaches_it() -> None:
    # Its version may carry subgraphs or attributes the rule does not read: nothing is proven.
    nodes = [
        helper.make_node("Add", ["w", "w"], ["ww"], name="static"),
        helper.make_node("Max", ["x", "ww"], ["y"], name="rows"),  # Max's rule covers opset 1 on
    ]
    found = RowAnalysis(_model(nodes, {"": 6})).refusal()
    assert found is not None and (found.node, found.op_type) == ("'static'", "Add")
    assert found.reason.startswith("is Add of ai.onnx opset 6, older than the analysis knows it")


def test_each_operator_is_registered_on_a_line_of_its_own_that_grep_finds() -> None:
    lines: dict[tuple[str, str], list[str]] = {}
    pattern = re.compile(r'^@rule\("([^"]*)", "([^"]+)", since=(\d+)\)')
    for path in sorted(SRC.rglob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            found = pattern.match(line)
            if found:
                domain, op, since = found.groups()
                key = (domain or "ai.onnx", op)
                lines.setdefault(key, []).append(f"{path.name}:{number} since={since}")
    entries = rule_entries()
    assert len(entries) > 150
    for entry in entries:
        where = lines.get((entry.domain, entry.op_type), [])
        assert len(where) == 1, (entry, where)
        assert where[0].endswith(f"since={entry.since}"), (entry, where)
    assert len(lines) == len(entries)


def _schema_versions() -> dict[tuple[str, str], list[int]]:
    versions: dict[tuple[str, str], list[int]] = {}
    for schema in onnx.defs.get_all_schemas_with_history():
        versions.setdefault((schema.domain or "ai.onnx", schema.name), []).append(
            schema.since_version
        )
    return versions


def test_each_rule_starts_at_a_version_onnx_defines_for_its_operator() -> None:
    versions = _schema_versions()
    checked = 0
    for entry in rule_entries():
        known = versions.get((entry.domain, entry.op_type))
        if known is None:  # com.microsoft, and ORT's SimplifiedLayerNormalization in ai.onnx
            assert entry.since == 1, entry
            continue
        # A rule starts at its operator's first version or at a later version of it, never
        # below (a model of an older opset than the operator is not valid ONNX).
        assert entry.since in known, (entry, sorted(known))
        checked += 1
    assert checked > 150


def test_a_second_rule_for_an_operator_is_refused_when_it_registers() -> None:
    from sharedml.rows import _registry

    before = dict(_registry.RULES)
    with pytest.raises(ValueError, match=r"Relu \(ai\.onnx\) is registered twice"):
        _registry.rule("", "Relu", since=14)(lambda n: n.like(n.need(0)))
    assert before == _registry.RULES

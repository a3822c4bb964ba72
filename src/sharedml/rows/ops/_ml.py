"""ONNX-ML (ai.onnx.ml): one result row per input row of a [N, features] input."""

from __future__ import annotations

from sharedml.rows._dims import BATCH, ONE, Dim, opaque
from sharedml.rows._facts import Fact, rows_among
from sharedml.rows._registry import Node, Refused, rule, summary


@rule("ai.onnx.ml", "LinearClassifier", since=1)
@rule("ai.onnx.ml", "LinearRegressor", since=1)
@rule("ai.onnx.ml", "SVMClassifier", since=1)
@rule("ai.onnx.ml", "SVMRegressor", since=1)
@rule("ai.onnx.ml", "TreeEnsembleClassifier", since=1)
@rule("ai.onnx.ml", "TreeEnsembleRegressor", since=1)
@rule("ai.onnx.ml", "TreeEnsemble", since=5)
@rule("ai.onnx.ml", "Normalizer", since=1)
@rule("ai.onnx.ml", "Scaler", since=1)
@rule("ai.onnx.ml", "Binarizer", since=1)
@rule("ai.onnx.ml", "Imputer", since=1)
@rule("ai.onnx.ml", "LabelEncoder", since=1)
@rule("ai.onnx.ml", "OneHotEncoder", since=1)
@rule("ai.onnx.ml", "ZipMap", since=1)
@rule("ai.onnx.ml", "ArrayFeatureExtractor", since=1)
@rule("ai.onnx.ml", "FeatureVectorizer", since=1)
@rule("ai.onnx.ml", "CategoryMapper", since=1)
@summary("one result row per input row: rows on axis 0 of a matrix")
def _ml_rowwise(n: Node) -> list[Fact]:
    facts = [f for f in n.ins if f is not None]
    rows = rows_among(facts)
    if not rows:
        return [n.plain(None) for _ in range(n.outputs)]
    if n.op == "ArrayFeatureExtractor":
        n.require_static([1], "indices")
        facts = facts[:1]
    for f in rows:
        if f.axis != 0 or f.fold != ONE:
            raise Refused("takes its samples from axis 0, where the rows are not")
        if (
            f.rank is not None
            and f.rank < 2
            and n.op
            not in ("LabelEncoder", "CategoryMapper", "Binarizer", "Imputer", "Scaler", "ZipMap")
        ):
            raise Refused("reads a one-dimensional input as a single sample")
    if len(rows) != len(facts):
        raise Refused("combines rows with a tensor that has none")
    first = rows[0]
    outs = []
    for k in range(n.outputs):
        if n.op in (
            "LabelEncoder",
            "CategoryMapper",
            "Binarizer",
            "Imputer",
            "Scaler",
            "Normalizer",
        ):
            outs.append(n.like(first))
        elif n.op in ("ZipMap",):
            outs.append(n.rows([first.shape[0] if first.shape else Dim.of(BATCH)], 0))
        elif k == 0 and n.op.endswith("Classifier"):
            outs.append(n.rows([Dim.of(BATCH)], 0))
        else:
            outs.append(n.rows([Dim.of(BATCH), opaque()], 0))
    return outs

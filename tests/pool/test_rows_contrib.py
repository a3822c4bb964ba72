"""ONNX Runtime's contrib operators: a rule only where every input form keeps the rows apart.

``Attention``, ``MultiHeadAttention``, ``RotaryEmbedding`` and ``EmbedLayerNormalization``
read some inputs per batch entry (key lengths, caches, position or segment ids), and some tell
an input's form by its length (``mask_index`` of ``B``, ``2B`` or ``3B + 2`` entries). A static
tensor there was made for some batch size: merged requests would read it entry by entry against
their rows, so the analysis refuses it and names the input. Each refused model here is shown to
give merged callers other results than solo ones under ORT (or to fail merged), and each
accepted form to give every caller its solo outputs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
from onnx import ModelProto, TensorProto, helper, numpy_helper
from onnxruntime.capi.onnxruntime_pybind11_state import Fail, InvalidArgument

from sharedml.rows import RowAnalysis

F = TensorProto.FLOAT
I32 = TensorProto.INT32
I64 = TensorProto.INT64
MS = "com.microsoft"
S, H, HEADS = 4, 8, 2  # sequence, hidden size, heads
RNG = np.random.default_rng(0)


def c(name: str, value: Any, dtype: Any = np.float32) -> TensorProto:
    return numpy_helper.from_array(np.asarray(value, dtype=dtype), name)


def w(name: str, *shape: int) -> TensorProto:
    return c(name, RNG.standard_normal(shape) / np.sqrt(shape[0]))


def mk(
    node: Any, inputs: Sequence[tuple[str, int, Sequence[Any]]], inits: Sequence[TensorProto]
) -> ModelProto:
    outputs = [helper.make_tensor_value_info(o, F, None) for o in node.output[:1]]
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs],
        outputs,
        list(inits),
    )
    m = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)]
    )
    m.ir_version = 8
    return m


X = ("x", F, ["N", S, H])
ATTENTION_WEIGHTS = [w("wqkv", H, 3 * H), w("bqkv", 3 * H)]


def attention(mask: str = "", past: str = "", bias: str = "") -> Any:
    return helper.make_node(
        "Attention",
        ["x", "wqkv", "bqkv", mask, past, bias],
        ["y", "present"] if past else ["y"],
        domain=MS,
        num_heads=HEADS,
    )


def mha(mask: str = "", key: str = "x") -> Any:
    return helper.make_node(
        "MultiHeadAttention", ["x", key, "x", "", mask], ["y"], domain=MS, num_heads=HEADS
    )


def rotary(ids: TensorProto) -> ModelProto:
    return mk(
        helper.make_node(
            "RotaryEmbedding", ["x", "pos", "cos", "sin"], ["y"], domain=MS, num_heads=HEADS
        ),
        [X],
        [ids, w("cos", 16, H // HEADS // 2), w("sin", 16, H // HEADS // 2)],
    )


def embed_layer_norm(segment: TensorProto) -> ModelProto:
    return mk(
        helper.make_node(
            "EmbedLayerNormalization",
            ["ids", "seg", "we", "pe", "se", "gamma", "beta"],
            ["y", "mask_index"],
            domain=MS,
        ),
        [("ids", I32, ["N", S])],
        [
            segment,
            w("we", 10, H),
            w("pe", 8, H),
            w("se", 2, H),
            c("gamma", np.ones(H)),
            c("beta", np.zeros(H)),
        ],
    )


def x_feeds(rows: Sequence[int] = (1, 2, 1)) -> list[dict[str, np.ndarray]]:
    return [{"x": RNG.standard_normal((r, S, H)).astype(np.float32)} for r in rows]


def with_lengths(feeds: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
    return [
        {**f, "lengths": np.full(len(f["x"]), 1 + k % S, np.int32)} for k, f in enumerate(feeds)
    ]


ID_FEEDS = [{"ids": RNG.integers(0, 10, (r, S)).astype(np.int32)} for r in (1, 1)]

# name -> (model, feeds, the input the refusal names)
REFUSED: dict[str, tuple[Callable[[], ModelProto], list[dict[str, np.ndarray]], str]] = {
    "Attention, a static mask_index of 2 entries (end and start of one batch entry)": (
        lambda: mk(attention(mask="m"), [X], [*ATTENTION_WEIGHTS, c("m", [3, 1], np.int32)]),
        x_feeds((1, 1)),
        "mask_index",
    ),
    "Attention, a static 2-D mask": (
        lambda: mk(
            attention(mask="m"), [X], [*ATTENTION_WEIGHTS, c("m", [[1, 1, 0, 0]], np.int32)]
        ),
        x_feeds((1, 1)),
        "mask_index",
    ),
    "Attention, a static past": (
        lambda: mk(
            attention(past="p"),
            [X],
            [*ATTENTION_WEIGHTS, w("p", 2, 1, HEADS, 3, H // HEADS)],
        ),
        x_feeds((1, 1)),
        "past",
    ),
    "Attention, a static attention bias with 2 on the batch axis": (
        lambda: mk(attention(bias="b"), [X], [*ATTENTION_WEIGHTS, w("b", 2, HEADS, S, S)]),
        x_feeds((2, 2)),
        "attention_bias",
    ),
    "MultiHeadAttention, a static key padding mask": (
        lambda: mk(mha(mask="m"), [X], [c("m", [[1, 1, 1, 0]], np.int32)]),
        x_feeds((1, 1)),
        "key_padding_mask",
    ),
    "MultiHeadAttention, a static key": (
        lambda: mk(mha(key="k"), [X], [w("k", 1, S, H)]),
        x_feeds((1, 1)),
        "key",
    ),
    "RotaryEmbedding, static position ids of one batch entry": (
        lambda: rotary(c("pos", [list(range(S))], np.int64)),
        x_feeds((1, 1)),
        "position_ids",
    ),
    "EmbedLayerNormalization, static segment ids": (
        lambda: embed_layer_norm(c("seg", [[0, 1, 1, 0]], np.int32)),
        ID_FEEDS,
        "segment_ids",
    ),
}

ACCEPTED: dict[str, tuple[Callable[[], ModelProto], list[dict[str, np.ndarray]]]] = {
    "Attention, key lengths per row (mask_index [N])": (
        lambda: mk(attention(mask="lengths"), [X, ("lengths", I32, ["N"])], ATTENTION_WEIGHTS),
        with_lengths(x_feeds()),
    ),
    "Attention, one static attention bias for every row ([1, heads, S, S])": (
        lambda: mk(attention(bias="b"), [X], [*ATTENTION_WEIGHTS, w("b", 1, HEADS, S, S)]),
        x_feeds(),
    ),
    "MultiHeadAttention, self-attention": (lambda: mk(mha(), [X], []), x_feeds()),
    "SimplifiedLayerNormalization in the ONNX domain (ORT's RMS norm)": (
        lambda: mk(
            helper.make_node("SimplifiedLayerNormalization", ["x", "scale"], ["y"], axis=-1),
            [X],
            [w("scale", H)],
        ),
        x_feeds(),
    ),
    "RotaryEmbedding, one static position offset ([1])": (
        lambda: rotary(c("pos", [1], np.int64)),
        x_feeds(),
    ),
}


def run(m: ModelProto, feed: dict[str, np.ndarray]) -> np.ndarray:
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    out: np.ndarray = sess.run(None, feed)[0]
    return out


def merged_and_solo(
    m: ModelProto, feeds: Sequence[dict[str, np.ndarray]]
) -> tuple[np.ndarray, np.ndarray]:
    together = run(m, {k: np.concatenate([f[k] for f in feeds]) for k in feeds[0]})
    return together, np.concatenate([run(m, f) for f in feeds])


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_static_tensor_read_per_batch_entry_is_refused_naming_the_input(case: str) -> None:
    build, feeds, name = REFUSED[case]
    m = build()
    refusal = RowAnalysis(m).refusal()
    assert refusal is not None, "accepted"
    assert f"({name})" in refusal.reason, refusal.describe()
    solo = np.concatenate([run(m, f) for f in feeds])  # each request alone runs
    merged = {k: np.concatenate([f[k] for f in feeds]) for k in feeds[0]}
    try:
        together = run(m, merged)
    except (InvalidArgument, Fail):
        pass  # the requests run alone, so the merge is what ORT refuses: no batch either way
    else:
        assert not np.allclose(together, solo, rtol=1e-4, atol=1e-4), "ORT keeps rows apart"


@pytest.mark.parametrize("case", sorted(ACCEPTED))
def test_a_batch_form_of_a_contrib_op_is_accepted_and_merged_rows_equal_solo(case: str) -> None:
    build, feeds = ACCEPTED[case]
    m = build()
    refusal = RowAnalysis(m).refusal()
    assert refusal is None, refusal.describe()
    together, solo = merged_and_solo(m, feeds)
    np.testing.assert_allclose(together, solo, rtol=1e-4, atol=1e-5)

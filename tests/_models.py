"""Small deterministic models with weights in every placement prepare must handle.

A model is a chain of blocks on ``x: float32[1, D]``; each block multiplies by a ``DxD`` weight
stored one way: a graph initializer, a ``Constant`` node, or an initializer / ``Constant`` inside
an ``If`` branch, a ``Loop`` body or a ``Scan`` body (optionally nested). ``If`` blocks branch on
the graph input ``flag`` so that ORT cannot fold the branch away at load.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

PLACEMENTS = (
    "initializer",
    "constant",
    "if_initializer",
    "if_constant",
    "loop_initializer",
    "loop_constant",
    "scan_initializer",
    "scan_constant",
    "nested_if_in_loop",
)
OPSET = 17


class _Builder:
    def __init__(self, dim: int, seed: int) -> None:
        self.dim = dim
        self.rng = np.random.default_rng(seed)
        self.counter = itertools.count()
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[TensorProto] = []

    def name(self, prefix: str) -> str:
        return f"{prefix}_{next(self.counter)}"

    def weight(self) -> np.ndarray:
        # Scaled so that a chain of blocks stays O(1): outputs remain comparable.
        return (self.rng.standard_normal((self.dim, self.dim)) / np.sqrt(self.dim)).astype(
            np.float32
        )

    def matmul_into(
        self,
        nodes: list[onnx.NodeProto],
        inits: list[TensorProto],
        x: str,
        as_constant: bool,
    ) -> str:
        """Append ``y = x @ W`` with W stored as an initializer or a Constant node."""
        w_name = self.name("W")
        w = numpy_helper.from_array(self.weight(), w_name)
        if as_constant:
            nodes.append(helper.make_node("Constant", [], [w_name], value=w))
        else:
            inits.append(w)
        y = self.name("mm")
        nodes.append(helper.make_node("MatMul", [x, w_name], [y]))
        return y

    def branch_graph(self, as_constant: bool, tag: str) -> onnx.GraphProto:
        """An If branch: captures ``x`` (outer scope), returns ``x @ W``."""
        nodes: list[onnx.NodeProto] = []
        inits: list[TensorProto] = []
        y = self.matmul_into(nodes, inits, self.current, as_constant)
        out = self.name(f"{tag}_out")
        nodes.append(helper.make_node("Identity", [y], [out]))
        return helper.make_graph(
            nodes,
            self.name(tag),
            [],
            [helper.make_tensor_value_info(out, TensorProto.FLOAT, [1, self.dim])],
            initializer=inits,
        )

    def block(self, x: str, placement: str) -> str:
        self.current = x
        if placement in ("initializer", "constant"):
            return self.matmul_into(self.nodes, self.inits, x, placement == "constant")
        if placement.startswith("if_"):
            as_constant = placement == "if_constant"
            then_g = self.branch_graph(as_constant, "then")
            else_g = self.branch_graph(as_constant, "else")
            y = self.name("if")
            self.nodes.append(
                helper.make_node("If", ["flag"], [y], then_branch=then_g, else_branch=else_g)
            )
            return y
        if placement.startswith("loop_") or placement == "nested_if_in_loop":
            return self.loop_block(x, placement)
        if placement.startswith("scan_"):
            return self.scan_block(x, placement == "scan_constant")
        raise ValueError(placement)

    def loop_block(self, x: str, placement: str) -> str:
        trip = self.name("trip")
        self.inits.append(numpy_helper.from_array(np.array(2, dtype=np.int64), trip))
        cond0 = self.name("cond0")
        self.inits.append(numpy_helper.from_array(np.array(True), cond0))
        it, cin, vin = self.name("it"), self.name("cin"), self.name("vin")
        cout, vout = self.name("cout"), self.name("vout")
        nodes: list[onnx.NodeProto] = [helper.make_node("Identity", [cin], [cout])]
        inits: list[TensorProto] = []
        if placement == "nested_if_in_loop":
            saved = self.current
            self.current = vin
            then_g = self.branch_graph(False, "then")
            else_g = self.branch_graph(True, "else")
            self.current = saved
            y = self.name("if")
            nodes.append(
                helper.make_node("If", ["flag"], [y], then_branch=then_g, else_branch=else_g)
            )
        else:
            y = self.matmul_into(nodes, inits, vin, placement == "loop_constant")
        half = self.name("half")
        inits.append(numpy_helper.from_array(np.array(0.5, dtype=np.float32), half))
        nodes.append(helper.make_node("Mul", [y, half], [vout]))
        body = helper.make_graph(
            nodes,
            self.name("body"),
            [
                helper.make_tensor_value_info(it, TensorProto.INT64, []),
                helper.make_tensor_value_info(cin, TensorProto.BOOL, []),
                helper.make_tensor_value_info(vin, TensorProto.FLOAT, [1, self.dim]),
            ],
            [
                helper.make_tensor_value_info(cout, TensorProto.BOOL, []),
                helper.make_tensor_value_info(vout, TensorProto.FLOAT, [1, self.dim]),
            ],
            initializer=inits,
        )
        out = self.name("loop")
        self.nodes.append(helper.make_node("Loop", [trip, cond0, x], [out], body=body))
        return out

    def scan_block(self, x: str, as_constant: bool) -> str:
        # Scan over the single row of x: state s[D] += row @ W.
        s0 = self.name("s0")
        self.inits.append(numpy_helper.from_array(np.zeros(self.dim, np.float32), s0))
        s_in, e_in, s_out = self.name("s_in"), self.name("e_in"), self.name("s_out")
        nodes: list[onnx.NodeProto] = []
        inits: list[TensorProto] = []
        y = self.matmul_into(nodes, inits, e_in, as_constant)
        nodes.append(helper.make_node("Add", [s_in, y], [s_out]))
        body = helper.make_graph(
            nodes,
            self.name("scan_body"),
            [
                helper.make_tensor_value_info(s_in, TensorProto.FLOAT, [self.dim]),
                helper.make_tensor_value_info(e_in, TensorProto.FLOAT, [self.dim]),
            ],
            [helper.make_tensor_value_info(s_out, TensorProto.FLOAT, [self.dim])],
            initializer=inits,
        )
        final = self.name("scan")
        self.nodes.append(helper.make_node("Scan", [s0, x], [final], body=body, num_scan_inputs=1))
        shape = self.name("shape")
        self.inits.append(numpy_helper.from_array(np.array([1, self.dim], np.int64), shape))
        out = self.name("reshape")
        self.nodes.append(helper.make_node("Reshape", [final, shape], [out]))
        return out


def build_model(
    placements: list[str] | tuple[str, ...], *, dim: int = 64, seed: int = 0
) -> onnx.ModelProto:
    """A chain of blocks, one per entry of ``placements``, ending in output ``y``."""
    b = _Builder(dim, seed)
    x = "x"
    for placement in placements:
        x = b.block(x, placement)
    b.nodes.append(helper.make_node("Identity", [x], ["y"]))
    graph = helper.make_graph(
        b.nodes,
        "sharedml_test",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, dim]),
            helper.make_tensor_value_info("flag", TensorProto.BOOL, []),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, dim])],
        initializer=b.inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def save_model(
    model: onnx.ModelProto, path: Path, *, external: str | None = None, threshold: int = 1024
) -> Path:
    """Save ``model``; ``external`` ("one" or "many") stores weights in external files."""
    path.parent.mkdir(parents=True, exist_ok=True)
    model = onnx.ModelProto.FromString(model.SerializeToString())  # onnx.save mutates its input
    if external is None:
        onnx.save_model(model, str(path))
    elif external == "one":
        onnx.save_model(
            model,
            str(path),
            save_as_external_data=True,
            all_tensors_to_one_file=True,
            location=path.stem + ".data",
            size_threshold=threshold,
        )
    elif external == "many":
        onnx.save_model(
            model,
            str(path),
            save_as_external_data=True,
            all_tensors_to_one_file=False,
            size_threshold=threshold,
        )
    else:
        raise ValueError(external)
    return path


def feeds(dim: int = 64, *, flag: bool = True, seed: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((1, dim)).astype(np.float32), "flag": np.array(flag)}


def run_ort(path: Path | str, feed: dict[str, np.ndarray]) -> np.ndarray:
    import onnxruntime as ort

    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return sess.run(None, feed)[0]


def batchable_model(
    path: Path, *, dim: int = 32, layers: int = 2, seed: int = 0, extra_input: bool = False
) -> Path:
    """An MLP on ``x: float32[batch, dim]`` -> ``y: float32[batch, dim]`` (rows independent).

    With ``extra_input``, a second input ``scale: float32[batch, 1]`` multiplies the output, so
    that requests carry two inputs whose rows must stay together.
    """
    rng = np.random.default_rng(seed)
    nodes, inits = [], []
    x = "x"
    for i in range(layers):
        w = (rng.standard_normal((dim, dim)) / np.sqrt(dim)).astype(np.float32)
        b = rng.standard_normal(dim).astype(np.float32) * np.float32(0.1)
        inits += [numpy_helper.from_array(w, f"w{i}"), numpy_helper.from_array(b, f"b{i}")]
        nodes += [
            helper.make_node("MatMul", [x, f"w{i}"], [f"mm{i}"]),
            helper.make_node("Add", [f"mm{i}", f"b{i}"], [f"add{i}"]),
            helper.make_node("Relu", [f"add{i}"], [f"h{i}"]),
        ]
        x = f"h{i}"
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", dim])]
    if extra_input:
        inputs.append(helper.make_tensor_value_info("scale", TensorProto.FLOAT, ["batch", 1]))
        nodes.append(helper.make_node("Mul", [x, "scale"], ["y"]))
    else:
        nodes.append(helper.make_node("Identity", [x], ["y"]))
    graph = helper.make_graph(
        nodes,
        "batchable",
        inputs,
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["out_rows", dim])],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 8
    return save_model(model, path)


def fixed_at_one(source: Path, path: Path) -> Path:
    """A copy of the model at ``source`` with axis 0 of its inputs and outputs fixed at 1."""
    model = onnx.load(source)
    for value in (*model.graph.input, *model.graph.output):
        value.type.tensor_type.shape.dim[0].Clear()
        value.type.tensor_type.shape.dim[0].dim_value = 1
    return save_model(model, path)


def conv_model(path: Path, *, channels: int = 4, size: int = 8, seed: int = 0) -> Path:
    """A 3x3 convolution and a ReLU on ``x: float32[batch, channels, size, size]``."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((channels, channels, 3, 3)) / (3 * np.sqrt(channels))).astype(
        np.float32
    )
    shape = ["batch", channels, size, size]
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w"], ["c"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
            helper.make_node("Relu", ["c"], ["y"]),
        ],
        "conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
        initializer=[numpy_helper.from_array(w, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 8
    return save_model(model, path)

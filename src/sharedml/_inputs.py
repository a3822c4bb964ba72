"""The inputs a measurement feeds a model: generated from its signature, symbolic dims set.

Integers are 1 rather than random: a valid row of any embedding table of at least 2 rows
(Gather), a non-zero divisor, and an attention mask that keeps every position. Floats are in
[0, 1) from a fixed seed, so every strategy runs the same numbers.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Mapping
from typing import Any

from sharedml._errors import MeasurementError

__all__ = ["InputSpec", "generate", "input_specs"]


_GENERATED_DTYPES = frozenset(
    (
        "bool",
        "float16",
        "float32",
        "float64",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "str",
    )
)


@dataclasses.dataclass(frozen=True)
class InputSpec:
    """One model input as the measuring child generates it.

    Attributes:
        name: The input's name.
        dtype: numpy dtype name (``"float32"``, ``"int64"``, ``"bool"``, ``"str"``, ...).
        shape: The concrete shape the child generates.
        dim_names: For each axis, the symbolic name it had in the model (``None`` for a fixed
            size; ``"?"`` for an unnamed dynamic axis, generated as 1).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    dim_names: tuple[str | None, ...]

    def describe(self) -> str:
        """``x float32[batch=1, 1024]``: the input as generated, symbolic axes named."""
        axes = [
            str(size) if dim is None else f"{dim}={size}"
            for size, dim in zip(self.shape, self.dim_names, strict=True)
        ]
        return f"{self.name} {self.dtype}[{', '.join(axes)}]"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}


def input_specs(
    model: Any, dims: Mapping[str, int] | None = None, *, model_name: str = "the model"
) -> tuple[InputSpec, ...]:
    """The inputs to generate for ``model`` (an ``onnx.ModelProto``).

    Symbolic dimensions are 1 unless ``dims`` names them.

    Args:
        model: The model's protobuf (``sharedml._prepare.load_graph`` gives it without data).
        dims: Sizes of symbolic dimensions, by name.
        model_name: How error messages name the model.

    Returns:
        One spec per graph input that is not an initializer, in graph order.

    Raises:
        ValueError: ``dims`` names a dimension the model does not have, or a size below 0.
        MeasurementError: an input whose type inspect cannot generate (sequences, maps,
            bfloat16, ...).
    """
    import onnx

    checked: dict[str, int] = {}
    for name, size in (dims or {}).items():
        try:
            checked[name] = operator.index(size)  # ints only: no 2.5, no "2"
        except TypeError:
            checked[name] = -1
        if checked[name] < 0 or isinstance(size, bool):
            raise ValueError(f"Dimension {name!r} must be a non-negative integer, not {size!r}.")
    dims = checked
    graph = model.graph
    initializers = {t.name for t in graph.initializer}
    specs: list[InputSpec] = []
    seen_dims: set[str] = set()
    for value in graph.input:
        if value.name in initializers:
            continue  # IR < 4: initializers are listed as inputs with defaults
        kind = value.type.WhichOneof("value")
        if kind != "tensor_type":
            raise MeasurementError(
                f"Input '{value.name}' of {model_name} is a {kind or 'value of unknown type'}; "
                "inspect can generate only tensor inputs."
            )
        tensor_type = value.type.tensor_type
        try:
            dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor_type.elem_type)
            dtype_name = "str" if dtype.kind in "OSU" else dtype.name
        except Exception:
            dtype_name = onnx.TensorProto.DataType.Name(tensor_type.elem_type).lower()
        if dtype_name not in _GENERATED_DTYPES:
            raise MeasurementError(
                f"Input '{value.name}' of {model_name} has type {dtype_name}; inspect can "
                f"generate inputs of types {', '.join(sorted(_GENERATED_DTYPES))}."
            )
        if not tensor_type.HasField("shape"):
            raise MeasurementError(
                f"Input '{value.name}' of {model_name} has no shape (not even a rank), so inspect "
                "cannot generate it. Give the input a shape in the model (onnx.shape_inference "
                "or the exporter's dynamic_axes)."
            )
        shape: list[int] = []
        names: list[str | None] = []
        for dim in tensor_type.shape.dim:
            if dim.HasField("dim_value"):
                shape.append(int(dim.dim_value))
                names.append(None)
            elif dim.dim_param:
                seen_dims.add(dim.dim_param)
                shape.append(dims.get(dim.dim_param, 1))
                names.append(dim.dim_param)
            else:
                shape.append(1)
                names.append("?")
        specs.append(InputSpec(value.name, dtype_name, tuple(shape), tuple(names)))
    unknown = sorted(set(dims) - seen_dims)
    if unknown:
        known = ", ".join(sorted(seen_dims)) or "none"
        raise ValueError(
            f"{model_name[:1].upper() + model_name[1:]} has no symbolic dimension "
            f"{', '.join(repr(u) for u in unknown)} (its symbolic dimensions: {known})."
        )
    return tuple(specs)


def generate(spec: Mapping[str, Any]) -> Any:
    """An input that keeps every common op valid: floats in [0, 1), integers 1, bools False.

    Integers are 1 rather than random: a valid row of any embedding table of at least 2 rows
    (Gather), a non-zero divisor, and an attention mask that keeps every position.
    """
    import numpy as np

    shape = tuple(spec["shape"])
    dtype = spec["dtype"]
    if dtype == "str":
        return np.full(shape, "", dtype=object)
    if dtype == "bool":
        return np.zeros(shape, dtype=np.bool_)
    if np.dtype(dtype).kind == "f":
        rng = np.random.default_rng(0)
        return rng.random(shape, dtype=np.float64).astype(dtype)
    return np.ones(shape, dtype=dtype)

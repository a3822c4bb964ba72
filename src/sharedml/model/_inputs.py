"""The inputs a measurement feeds a model: generated from its signature, symbolic dims set.

Integers are 1 rather than random: a valid row of any embedding table of at least 2 rows
(Gather), a non-zero divisor, and an attention mask that keeps every position. Floats are in
[0, 1) from a fixed seed, so every strategy runs the same numbers.

Symbolic dimensions nobody gave a size get one from the model (:class:`ChosenSize`): a batch
is 1; an image's height and width come from the model's metadata (``imgsz``) or are the
smallest multiple of the stride its Conv and pooling layers reach that is at least
:data:`PLAUSIBLE_IMAGE_SIZE`; any other dimension (a sequence, a number of samples) is
:data:`PLAUSIBLE_LENGTH`. A model's memory depends on them (a detector at 1x1 holds a fraction
of what it holds at 320x320), so every size chosen is reported, never passed silently.
"""

from __future__ import annotations

import dataclasses
import operator
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from sharedml._errors import MeasurementError
from sharedml.model import _dtypes

__all__ = [
    "PLAUSIBLE_IMAGE_SIZE",
    "PLAUSIBLE_LENGTH",
    "SIZE_CHOICES",
    "UNNAMED_DIM",
    "ChosenSize",
    "InputSpec",
    "chosen_sizes",
    "defaulted_dims",
    "described",
    "downsampling",
    "generate",
    "input_specs",
    "load_feeds",
]


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


PLAUSIBLE_IMAGE_SIZE = 224  # pixels: what image models are most often trained and served at
PLAUSIBLE_LENGTH = 128  # positions: a sentence of tokens, a short window of frames
_MAX_STRIDE = 64  # downsampling beyond this is a model's quirk, not a size constraint
# Metadata keys exporters use for an image model's input size (Ultralytics writes "imgsz").
_SIZE_KEYS = ("imgsz", "img_size", "image_size", "input_size", "inputsize")
# A stride this large on one axis often collapses it to 1 (a text recognizer's height of 48):
# where the plausible size fails, guess="strides" tries exactly the stride on such axes.
_COLLAPSING_STRIDE = 16
SIZE_CHOICES = ("plausible", "strides", "ones")
"""How :func:`input_specs` sizes symbolic dimensions nobody gave: tried in this order by
``inspect`` until a plain session runs (see :class:`ChosenSize`)."""
_STRIDED = frozenset(("Conv", "ConvInteger", "QLinearConv", "MaxPool", "AveragePool", "LpPool"))
_BATCH_NAMES = ("batch", "n", "b", "bs", "batch_size", "batchsize", "num_images")


@dataclasses.dataclass(frozen=True)
class ChosenSize:
    """A symbolic dimension that inspect gave a size, because nobody else did.

    Attributes:
        input: The input it was first seen in.
        axis: Its axis there.
        dim: Its symbolic name (``"?"`` for an unnamed axis).
        size: The size generated.
        role: ``"batch"``, ``"image"`` (a height or width) or ``"length"`` (anything else).
        why: Where the size comes from, for the report.
    """

    input: str
    axis: int
    dim: str
    size: int
    role: str
    why: str

    @property
    def degenerate(self) -> bool:
        """A height, width or length of 1: a model measured at a size traffic never has."""
        return self.role != "batch" and self.size == 1

    def describe(self) -> str:
        """``x: height=224`` (an unnamed axis: ``x axis 2=224``)."""
        name = self.dim if self.dim != UNNAMED_DIM else f"axis {self.axis}"
        return f"{self.input}: {name}={self.size}"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class InputSpec:
    """One model input as the measuring child generates it.

    Attributes:
        name: The input's name.
        dtype: numpy dtype name (``"float32"``, ``"int64"``, ``"bool"``, ``"str"``, ...).
        shape: The concrete shape the child generates.
        dim_names: For each axis, the symbolic name it had in the model (``None`` for a fixed
            size; ``"?"`` for an unnamed dynamic axis, generated as 1).
        source: ``"generated"`` (from the model's signature, symbolic dims from ``dims``),
            ``"shape"`` (generated at a shape the caller gave, ``--shape``) or ``"file"``
            (the caller's values, ``--inputs feeds.npz``).
        chosen: The symbolic axes of this input whose size inspect chose (nobody gave one).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    dim_names: tuple[str | None, ...]
    source: str = "generated"
    chosen: tuple[ChosenSize, ...] = ()

    def describe(self) -> str:
        """``x float32[batch=1, 1024]``: the input as generated, symbolic axes named."""
        axes = [
            str(size) if dim is None else f"{dim}={size}"
            for size, dim in zip(self.shape, self.dim_names, strict=True)
        ]
        given = " (given)" if self.source == "file" else ""
        return f"{self.name} {self.dtype}[{', '.join(axes)}]{given}"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "name": self.name,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "source": self.source,
            "chosen": [c.to_dict() for c in self.chosen],
        }


# Paddle's exporter names every dynamic dim "?" (PP-OCR: x[-1, 3, "?", "?"]): one name for
# unrelated sizes. ORT does not hold inputs to it; neither does sharedml (an unnamed dim).
UNNAMED_DIM = "?"


def defaulted_dims(
    specs: Sequence[InputSpec], dims: Mapping[str, int] | None = None
) -> dict[str, list[str]]:
    """The symbolic dimensions whose size inspect chose because none was given, by input name.

    Each is ``name=size`` (``height=224``, ``batch=1``).

    Args:
        specs: From :func:`input_specs`.
        dims: The sizes the caller gave (``--dim``); inputs with a given shape or values have
            no defaulted axes.
    """
    named = set(dims or {})
    out: dict[str, list[str]] = {}
    for spec in specs:
        if spec.source != "generated":
            continue
        for dim, size in zip(spec.dim_names, spec.shape, strict=True):
            if dim is not None and dim not in named:
                out.setdefault(spec.name, []).append(f"{dim}={size}")
    return out


def chosen_sizes(specs: Sequence[InputSpec]) -> tuple[ChosenSize, ...]:
    """Every size inspect chose, each dimension once (a named one shared by inputs too)."""
    seen: set[tuple[str, ...]] = set()
    out: list[ChosenSize] = []
    for spec in specs:
        for c in spec.chosen:
            key = (c.dim,) if c.dim != UNNAMED_DIM else (c.input, str(c.axis))
            if key not in seen:
                seen.add(key)
                out.append(c)
    return tuple(out)


def _image_axes(dtype: str, axes: Sequence[Any]) -> tuple[int, ...]:
    """The height and width axes of an image input (NCHW or NHWC), else ()."""
    if len(axes) != 4 or dtype not in ("float16", "float32", "float64", "uint8"):
        return ()
    if isinstance(axes[1], int) and axes[1] in (1, 2, 3, 4):
        return (2, 3)
    if isinstance(axes[3], int) and axes[3] in (1, 2, 3, 4) and not isinstance(axes[1], int):
        return (1, 2)
    return ()


def _metadata_size(model: Any) -> tuple[int, int] | None:
    """An image size the exporter wrote into the model's metadata (``imgsz: [640, 640]``)."""
    import re

    for prop in getattr(model, "metadata_props", ()):
        if prop.key.lower() in _SIZE_KEYS:
            numbers = [int(n) for n in re.findall(r"\d+", prop.value)]
            if len(numbers) == 1 and numbers[0] > 0:
                return numbers[0], numbers[0]
            if len(numbers) >= 2 and numbers[-2] > 0 and numbers[-1] > 0:
                return numbers[-2], numbers[-1]
    return None


def downsampling(model: Any, input_name: str) -> tuple[int, int]:
    """The largest strides (height, width) the Conv and pooling layers fed by an input reach.

    Strides multiply along a path (three stride-2 convolutions: 8), each spatial axis on its
    own (a text recognizer's ``strides=[2, 1]`` halves the height only); an input whose
    height or width is not a multiple of its stride is cropped or padded somewhere, and one
    smaller than it is degenerate. Upsampling does not divide it back: the deepest level
    bounds the size. Each is at most 64.
    """
    reach: dict[str, tuple[int, int]] = {input_name: (1, 1)}
    deepest = (1, 1)
    for node in model.graph.node:
        known = [reach[i] for i in node.input if i in reach]
        if not known:
            continue
        h, w = max(k[0] for k in known), max(k[1] for k in known)
        if node.op_type in _STRIDED:
            for attr in node.attribute:
                if attr.name == "strides" and len(attr.ints) >= 2:
                    h, w = h * int(attr.ints[-2]), w * int(attr.ints[-1])
        h, w = min(h, _MAX_STRIDE), min(w, _MAX_STRIDE)
        deepest = (max(deepest[0], h), max(deepest[1], w))
        for out in node.output:
            reach[out] = (h, w)
    return deepest


def _is_batch(dim: str | None, axis: int, rank: int) -> bool:
    if (dim and dim.lower().replace("-", "_") in _BATCH_NAMES) or (dim and "batch" in dim.lower()):
        return True
    return axis == 0 and (rank >= 2 or not dim or dim == UNNAMED_DIM)


def _choose(
    model: Any, raw: Sequence[tuple[Any, str, list[Any]]], fixed: Mapping[str, Any], sizes: str
) -> dict[tuple[str, ...], ChosenSize]:
    """A size for every symbolic axis of the generated inputs that nobody gave one."""
    if sizes not in SIZE_CHOICES:
        raise ValueError(f"sizes must be one of {', '.join(SIZE_CHOICES)}, not {sizes!r}.")
    chosen: dict[tuple[str, ...], ChosenSize] = {}
    guess = sizes != "ones"
    from_metadata = _metadata_size(model) if guess else None
    for value, dtype, axes in raw:
        if value.name in fixed:
            continue
        image = _image_axes(dtype, axes)
        for axis, a in enumerate(axes):
            if isinstance(a, int):
                continue
            dim = a or UNNAMED_DIM
            key = (dim,) if a else (value.name, str(axis))
            if key in chosen:
                continue
            if _is_batch(a, axis, len(axes)):
                role, size, why = "batch", 1, "a batch of one"
            elif not guess:
                role = "image" if axis in image else "length"
                size, why = 1, "set to 1"
            elif axis in image:
                role = "image"
                if from_metadata is not None:
                    size = from_metadata[image.index(axis)]
                    why = "from the model's metadata"
                else:
                    step = downsampling(model, value.name)[image.index(axis)]
                    if sizes == "strides" and step >= _COLLAPSING_STRIDE:
                        size = step
                        why = f"the stride of {step} the model's Conv and pooling layers reach"
                    else:
                        size = -(-PLAUSIBLE_IMAGE_SIZE // step) * step
                        why = (
                            f"a multiple of {step}, the stride the model's Conv and pooling "
                            "layers reach"
                            if step > 1
                            else "a common image size"
                        )
            else:
                role, size, why = "length", PLAUSIBLE_LENGTH, "a plausible length"
            chosen[key] = ChosenSize(value.name, axis, dim, size, role, why)
    return chosen


def input_specs(
    model: Any,
    dims: Mapping[str, int] | None = None,
    *,
    shapes: Mapping[str, Sequence[int]] | None = None,
    given: Mapping[str, tuple[str, tuple[int, ...]]] | None = None,
    model_name: str = "the model",
    guess: str = "plausible",
) -> tuple[InputSpec, ...]:
    """The inputs to generate for ``model`` (an ``onnx.ModelProto``).

    A symbolic dimension has the size ``dims`` gives it, or that an input it appears in has
    from ``shapes`` or ``given`` (its sizes then hold for every input that shares the
    dimension's name, as ORT requires); else a size chosen from the model (see the module's
    docstring), recorded in :attr:`InputSpec.chosen`.

    Args:
        model: The model's protobuf (``sharedml.model._graph.load_graph`` gives it without
        data).
        dims: Sizes of symbolic dimensions, by name (each at least 1).
        shapes: Whole shapes of inputs, by input name (``--shape images=1x3x320x320``).
        given: ``(dtype, shape)`` of inputs whose values the caller gives (``--inputs``).
        model_name: How error messages name the model.
        guess: ``"plausible"`` heights, widths and lengths; ``"strides"``: image axes whose
            stride is 16 or more exactly at it (a recognizer's height), the rest plausible;
            ``"ones"``: all of them 1 (degenerate, what a model that refuses the others may
            still run at). Batches are 1 in every case.

    Returns:
        One spec per graph input that is not an initializer, in graph order.

    Raises:
        ValueError: ``dims`` names a dimension the model does not have, a size below 1, a
            shape or given input that the model has not or whose rank, fixed sizes or dtype
            differ, or two sizes for one dimension.
        MeasurementError: an input whose type inspect cannot generate (sequences, maps,
            bfloat16, ...).
    """
    checked: dict[str, int] = {}
    for name, size in (dims or {}).items():
        try:
            checked[name] = operator.index(size)  # ints only: no 2.5, no "2"
        except TypeError:
            checked[name] = -1
        if checked[name] < 1 or isinstance(size, bool):
            raise ValueError(f"Dimension {name!r} must be an integer of at least 1, not {size!r}.")
    dims = dict(checked)
    fixed: dict[str, tuple[tuple[int, ...], str]] = {
        name: (tuple(int(d) for d in shape), "shape") for name, shape in (shapes or {}).items()
    }
    wanted_dtypes: dict[str, str] = {}
    for name, (dtype, shape) in (given or {}).items():
        if name in fixed:
            raise ValueError(f"Input {name!r} has both --shape and values from --inputs.")
        fixed[name] = (tuple(shape), "file")
        wanted_dtypes[name] = dtype
    graph = model.graph
    initializers = {t.name for t in graph.initializer}
    real_inputs = [v for v in graph.input if v.name not in initializers]
    unknown_inputs = sorted(set(fixed) - {v.name for v in real_inputs})
    if unknown_inputs:
        raise ValueError(
            f"{_cap(model_name)} has no input {', '.join(repr(u) for u in unknown_inputs)} (its "
            f"inputs: {', '.join(v.name for v in real_inputs) or 'none'})."
        )
    raw: list[tuple[Any, str, list[Any]]] = []
    for value in real_inputs:
        kind = value.type.WhichOneof("value")
        if kind != "tensor_type":
            raise MeasurementError(
                f"Input '{value.name}' of {model_name} is a {kind or 'value of unknown type'}; "
                "inspect can generate only tensor inputs."
            )
        tensor_type = value.type.tensor_type
        try:
            np_dtype = _dtypes.np_dtype(tensor_type.elem_type)
            dtype_name = "str" if np_dtype.kind in "OSU" else np_dtype.name
        except Exception:
            dtype_name = _dtypes.onnx_name(tensor_type.elem_type)
        if dtype_name not in _GENERATED_DTYPES and value.name not in wanted_dtypes:
            raise MeasurementError(
                f"Input '{value.name}' of {model_name} has type {dtype_name}; inspect can "
                f"generate inputs of types {', '.join(sorted(_GENERATED_DTYPES))}."
            )
        if value.name in wanted_dtypes and wanted_dtypes[value.name] != dtype_name:
            raise ValueError(
                f"Input '{value.name}' of {model_name} is {dtype_name}, but --inputs gives "
                f"{wanted_dtypes[value.name]}."
            )
        if not tensor_type.HasField("shape"):
            if value.name in fixed:
                raw.append((value, dtype_name, [None] * len(fixed[value.name][0])))
                continue
            raise MeasurementError(
                f"Input '{value.name}' of {model_name} has no shape (not even a rank), so inspect "
                "cannot generate it. Give the input a shape in the model (onnx.shape_inference "
                "or the exporter's dynamic_axes), or pass --shape NAME=AxBxC."
            )
        axes: list[Any] = []
        for dim in tensor_type.shape.dim:
            if dim.HasField("dim_value") and dim.dim_value >= 0:  # Paddle writes -1: dynamic
                axes.append(int(dim.dim_value))
            elif dim.dim_param and dim.dim_param != UNNAMED_DIM:
                axes.append(dim.dim_param)
            else:
                axes.append(None)
        raw.append((value, dtype_name, axes))
    seen_dims = {a for _v, _d, axes in raw for a in axes if isinstance(a, str)}
    unknown = sorted(set(dims) - seen_dims)
    if unknown:
        known = ", ".join(sorted(seen_dims)) or "none"
        raise ValueError(
            f"{_cap(model_name)} has no symbolic dimension "
            f"{', '.join(repr(u) for u in unknown)} (its symbolic dimensions: {known})."
        )
    # Sizes that given shapes imply for symbolic dimensions, checked against each other.
    implied: dict[str, tuple[int, str]] = {}
    for value, _dtype, axes in raw:
        if value.name not in fixed:
            continue
        shape, _source = fixed[value.name]
        if len(shape) != len(axes):
            raise ValueError(
                f"Input '{value.name}' of {model_name} has rank {len(axes)} "
                f"({_axes_text(axes)}), but {_given_as(value.name, fixed)} {_shape_text(shape)}."
            )
        for size, axis in zip(shape, axes, strict=True):
            if size < 1:
                raise ValueError(
                    f"Input '{value.name}': every size must be at least 1, not "
                    f"{_shape_text(shape)}."
                )
            if isinstance(axis, int) and axis != size:
                raise ValueError(
                    f"Input '{value.name}' of {model_name} is {_axes_text(axes)}, but "
                    f"{_given_as(value.name, fixed)} {_shape_text(shape)}."
                )
            if isinstance(axis, str):
                before = implied.get(axis) or ((dims[axis], "--dim") if axis in dims else None)
                if before is not None and before[0] != size:
                    raise ValueError(
                        f"Dimension {axis!r} is {size} in input '{value.name}' but {before[0]} "
                        f"in {before[1]}."
                    )
                implied[axis] = (size, f"input '{value.name}'")
    sizes = dims | {axis: size for axis, (size, _where) in implied.items()}
    choices = _choose(model, raw, fixed, guess)
    specs: list[InputSpec] = []
    for value, dtype_name, axes in raw:
        mine: list[ChosenSize] = []
        if value.name in fixed:
            shape, source = fixed[value.name]
        else:
            shape_list = []
            for axis, a in enumerate(axes):
                if isinstance(a, int):
                    shape_list.append(a)
                elif a and a in sizes:
                    shape_list.append(sizes[a])
                else:
                    choice = choices[(a,) if a else (value.name, str(axis))]
                    mine.append(dataclasses.replace(choice, input=value.name, axis=axis))
                    shape_list.append(choice.size)
            shape, source = tuple(shape_list), "generated"
        names = tuple(None if isinstance(a, int) else (a or "?") for a in axes)
        specs.append(InputSpec(value.name, dtype_name, tuple(shape), names, source, tuple(mine)))
    return tuple(specs)


def _cap(text: str) -> str:
    return text[:1].upper() + text[1:]


def _axes_text(axes: Sequence[Any]) -> str:
    return "[" + ", ".join("?" if a is None else str(a) for a in axes) + "]"


def _shape_text(shape: Sequence[int]) -> str:
    return "x".join(str(d) for d in shape) or "a scalar"


def _given_as(name: str, fixed: Mapping[str, tuple[tuple[int, ...], str]]) -> str:
    return "--shape gives" if fixed[name][1] == "shape" else "--inputs gives"


def load_feeds(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The arrays of an ``.npz`` file of inputs (``numpy.savez``), by input name.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not a readable ``.npz`` of arrays (object arrays are refused: loading them
            would unpickle).
    """
    import numpy as np

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--inputs: '{path}' does not exist.")
    try:
        with np.load(path, allow_pickle=False) as data:
            return {name: data[name] for name in data.files}
    except Exception as exc:
        raise ValueError(
            f"--inputs: '{path}' is not a numpy .npz file of arrays ({exc}). Write one with "
            "numpy.savez('feeds.npz', input_name=array, ...)."
        ) from None


def described(feeds: Mapping[str, Any]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """``(dtype name, shape)`` of each given array, as :func:`input_specs` takes ``given``.

    Strings, bytes and objects are ``"str"``: the dtype name inputs of type string have here.
    """
    return {
        name: ("str" if a.dtype.kind in "OSU" else a.dtype.name, tuple(a.shape))
        for name, a in feeds.items()
    }


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

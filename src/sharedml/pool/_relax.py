"""The graph a batching pool's sessions load: the shapes the row analysis proved, and no others.

ONNX Runtime takes a model's declared shapes as facts: a ``value_info`` (or a graph output, or a
subgraph's input) declared ``[1, 4]`` lets it fold ``Shape(t)`` into the constant ``[1, 4]``
while the graph is loaded, whatever ``t`` holds at run time. The row-independence analysis
(:class:`~sharedml.rows.RowAnalysis`) derives every shape from the graph's inputs and
trusts no declaration, so a model whose declarations lie (an export that left a second output
out of ``dynamic_axes`` declares it ``[1, 4]``) would be proven batchable while ORT runs another
graph, one whose ``Reshape(x, [Shape(t)[0], -1])`` joins every caller's rows. So the pool never
lets ORT run a graph that declares what the analysis did not prove: the sessions of a batching
pool load :func:`relax`'s copy of the *prepared* graph, in which

- every ``value_info``, at any depth, is dropped (ORT infers the shapes again, from the inputs);
- subgraphs (``If``/``Loop``/``Scan`` bodies) declare no input or output shape, but for a
  ``Loop`` body's iteration number and condition, which are scalars by the operator's
  definition (ORT's ``Loop`` needs them);
- a graph output keeps a declared dim only where the analysis proved that very dim: a constant
  it computed, a symbolic dim of an input it followed, or the rows' axis named as an input's
  axis 0 is; any other is left unknown, and a rows' axis declared otherwise (``1`` in a batch-1
  export) becomes the symbolic dim :data:`ROWS_DIM`;
- the graph's inputs keep their shapes (requests are checked against them), but for an axis 0
  fixed at 1 where the analysis ran in its ``fixed_rows`` mode (models exported with axis 0
  fixed at 1, served batched with that axis relaxed): it becomes :data:`ROWS_DIM`.

Where nothing changes, the pool loads the prepared graph itself. Otherwise the copy is a
``models`` cache entry of its own (:func:`relaxed_model_for`), keyed by the prepared graph's
bytes, whose weights files are hard links to the prepared model's: the same files (and inodes),
so the weights are still mapped once per process, and every route (ORT's optimized and prepacked
forms included) is built from the copy. The model the caller gave is never written. Requests are
still checked against the source's shapes (one row each, for a model fixed at 1).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sharedml._errors import NotBatchableError
from sharedml.cache._entries import Built, ensure_entry
from sharedml.cache._locks import lend_hold
from sharedml.cache._root import Cache
from sharedml.model._graph import external_locations
from sharedml.model._proto import AttributeProto, GraphProto, ModelProto
from sharedml.prepared._format import read_manifest
from sharedml.route._planner import SessionRecipe
from sharedml.rows import ONE, Dim, Fact, RowAnalysis

__all__ = [
    "ROWS_DIM",
    "Relaxed",
    "fixed_row_inputs",
    "relax",
    "relaxed_graph",
    "relaxed_model_for",
    "relaxed_recipe",
]

ROWS_DIM = "sharedml_rows"
"""The symbolic dim a relaxed graph declares on a rows' axis that was declared otherwise."""

# Part of the entry's key: a new rule for what the copy declares, a new key (an entry written
# by an earlier rule may declare what this one drops).
_KEY_PREFIX = b"sharedml relaxed rows 2\0"
_MODEL_NAME = "model.onnx"
_NAMED = 3  # declarations a reason names before it says "and N more"


@dataclasses.dataclass(frozen=True)
class Relaxed:
    """The graph a batching pool's sessions load, and what it stopped declaring.

    Attributes:
        graph: The copy (the prepared graph's own message where nothing changed).
        changed: The values whose declared shapes were dropped or changed, in graph order.
        fixed_rows: Whether inputs fixed at 1 on axis 0 were relaxed to :data:`ROWS_DIM`.
    """

    graph: ModelProto
    changed: tuple[str, ...]
    fixed_rows: bool

    @property
    def reason(self) -> str:
        """What ``pool.batching_reason`` adds ("" where the prepared graph is loaded as it is)."""
        if self.fixed_rows:
            return (
                f"; the model fixes axis 0 at 1, so the sessions load its prepared graph with "
                f"that axis relaxed to '{ROWS_DIM}' (the model as given is unchanged)"
            )
        if not self.changed:
            return ""
        names = ", ".join(f"'{n}'" for n in self.changed[:_NAMED])
        more = len(self.changed) - _NAMED
        return (
            f"; the sessions load its prepared graph without the shapes it declares for {names}"
            + (f" and {more} more" if more > 0 else "")
            + ", which the analysis did not prove (ONNX Runtime would take them as facts; the "
            "model as given is unchanged)"
        )


def fixed_row_inputs(model: ModelProto) -> list[str]:
    """The graph inputs (initializers aside) whose axis 0 is fixed at 1."""
    initializers = {t.name for t in model.graph.initializer}
    found = []
    for value in model.graph.input:
        if value.name in initializers or not value.type.HasField("tensor_type"):
            continue
        tensor = value.type.tensor_type
        if tensor.HasField("shape") and tensor.shape.dim:
            d0 = tensor.shape.dim[0]
            if d0.HasField("dim_value") and d0.dim_value == 1:
                found.append(value.name)
    return found


def relax(model: ModelProto, analysis: RowAnalysis) -> Relaxed:
    """The copy of ``model`` that declares only what ``analysis`` proved (see the module).

    Args:
        model: The prepared graph (external data not loaded).
        analysis: The analysis that proved ``model`` batchable (``refusal()`` is None).
    """
    relaxed = ModelProto()
    relaxed.CopyFrom(model)
    changed: list[str] = []
    _undeclare(relaxed.graph, changed)
    graph = relaxed.graph
    batch_params = analysis.batch_params
    rows_dim = _rows_dim(graph, batch_params)
    fixed = False
    if analysis.fixed_rows:
        for name in fixed_row_inputs(relaxed):
            value = next(v for v in graph.input if v.name == name)
            dim = value.type.tensor_type.shape.dim[0]
            dim.Clear()
            dim.dim_param = rows_dim
            fixed = True
    outputs = dict(analysis.outputs())
    for value in graph.output:
        before = value.type.SerializeToString()
        fact = outputs.get(value.name)
        if fact is None or not value.type.HasField("tensor_type"):
            _clear_shapes(value.type)
        else:
            _keep_proven(value.type.tensor_type, fact, batch_params, rows_dim)
        if value.type.SerializeToString() != before:
            changed.append(value.name)
    if not fixed and not changed:
        return Relaxed(model, (), False)
    return Relaxed(relaxed, tuple(changed), fixed)


def relaxed_graph(model: ModelProto, analysis: RowAnalysis) -> ModelProto:
    """The graph of :func:`relax`: what a batching pool's sessions load."""
    return relax(model, analysis).graph


def _undeclare(graph: GraphProto, changed: list[str]) -> None:
    """Drop ``graph``'s ``value_info`` and, below the top, the shapes of its inputs and outputs."""
    changed.extend(v.name for v in graph.value_info)
    del graph.value_info[:]
    for node in graph.node:
        for attr in node.attribute:
            subs = [attr.g] if attr.type == AttributeProto.GRAPH else []
            if attr.type == AttributeProto.GRAPHS:
                subs = list(attr.graphs)
            body = node.op_type == "Loop" and node.domain in ("", "ai.onnx")
            for sub in subs:
                _undeclare(sub, changed)
                # A Loop body's iteration number and condition: scalars by the operator's
                # definition, which ORT's Loop needs declared.
                scalars = 2 if body and attr.name == "body" else 0
                for value, scalar in [
                    *((v, k < scalars) for k, v in enumerate(sub.input)),
                    *((v, k < scalars // 2) for k, v in enumerate(sub.output)),
                ]:
                    before = value.type.SerializeToString()
                    if scalar and value.type.HasField("tensor_type"):
                        value.type.tensor_type.shape.Clear()
                        value.type.tensor_type.shape.SetInParent()
                    else:
                        _clear_shapes(value.type)
                    if value.type.SerializeToString() != before:
                        changed.append(value.name)


def _clear_shapes(type_proto: Any) -> None:
    """Drop every shape a type declares (a tensor's, and those inside sequences, maps, ...)."""
    kind = type_proto.WhichOneof("value")
    if kind in ("tensor_type", "sparse_tensor_type"):
        getattr(type_proto, kind).ClearField("shape")
    elif kind in ("sequence_type", "optional_type"):
        _clear_shapes(getattr(type_proto, kind).elem_type)
    elif kind == "map_type":
        _clear_shapes(type_proto.map_type.value_type)


def _keep_proven(tensor: Any, fact: Fact, batch_params: frozenset[str], rows_dim: str) -> None:
    """Keep the dims of a graph output's declared shape that ``fact`` proves; forget the rest."""
    if not tensor.HasField("shape"):
        return
    dims = tensor.shape.dim
    if not fact.rows or fact.shape is None or len(fact.shape) != len(dims):
        tensor.ClearField("shape")  # not even the rank is proven
        return
    for axis, (dim, proven) in enumerate(zip(dims, fact.shape, strict=True)):
        if axis == fact.axis and fact.fold == ONE:
            # N rows: only an input's axis-0 name is the same size by proof
            if _declares(dim) and not (dim.HasField("dim_param") and dim.dim_param in batch_params):
                dim.Clear()
                dim.dim_param = rows_dim
        elif _declares(dim) and not _proves(proven, dim, batch_params):
            dim.Clear()


def _declares(dim: Any) -> bool:
    """Whether a dim says anything (a size, or a name that ORT may equate with others)."""
    if dim.HasField("dim_value"):
        return bool(dim.dim_value >= 0)  # Paddle writes -1 for dynamic, as ORT reads it
    return bool(dim.HasField("dim_param") and dim.dim_param)


def _proves(proven: Dim, dim: Any, batch_params: frozenset[str]) -> bool:
    if dim.HasField("dim_value"):
        return bool(proven.const == dim.dim_value)
    return dim.dim_param not in batch_params and proven == Dim.of(f"dim:{dim.dim_param}")


def _rows_dim(graph: GraphProto, batch_params: frozenset[str]) -> str:
    """:data:`ROWS_DIM`, or a variant of it that no input or output uses for another axis."""
    used = {
        d.dim_param
        for v in (*graph.input, *graph.output)
        if v.type.HasField("tensor_type")
        for d in v.type.tensor_type.shape.dim
        if d.HasField("dim_param")
    } - batch_params
    name, n = ROWS_DIM, 0
    while name in used:
        n += 1
        name = f"{ROWS_DIM}_{n}"
    return name


def relaxed_model_for(prepared: Path, relaxed: Relaxed, *, cache: Cache) -> Path:
    """The relaxed graph of the prepared model at ``prepared``, as a cache entry of its own.

    Args:
        prepared: The prepared model's path (its weights files beside it).
        relaxed: :func:`relax` of its graph.
        cache: The cache the pool's route was planned with.

    Raises:
        NotBatchableError: a weights file cannot be hard-linked into the cache (another file
            system): the weights would be copied, and mapped twice.
        CacheError: the cache fails sharedml's policy, or the entry cannot be published.
    """
    data = relaxed.graph.SerializeToString()
    key = hashlib.sha256(_KEY_PREFIX + data).hexdigest()
    manifest = read_manifest(relaxed.graph)
    known = {f.file: f.sha256 for f in manifest.files} if manifest is not None else {}
    # The manifest's files (a weights file with no tensor too: the store checks it) and any
    # other file a tensor names.
    locations = sorted(set(known) | external_locations(relaxed.graph.graph))

    def build(folder: Path) -> Built:
        for location in locations:
            target = folder / location
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(prepared.parent / location, target)
            except OSError as exc:
                raise NotBatchableError(
                    f"The weights file '{prepared.parent / location}' cannot be hard-linked into "
                    f"the cache ({exc.strerror or exc}), so the model cannot get the relaxed "
                    "graph that batching needs without a second copy of its weights. Put the "
                    "cache (SHAREDML_CACHE_DIR) on the model's file system, or run it without "
                    "batching (batching=False)."
                ) from None
        (folder / _MODEL_NAME).write_bytes(data)
        what = f"axis 0 fixed at 1 -> '{ROWS_DIM}'; " if relaxed.fixed_rows else ""
        return Built(
            meta={
                "source": str(prepared),
                "relaxed": f"{what}declared shapes the analysis did not prove dropped",
            },
            # The weights' digests as the manifest records them (the store checks them).
            sha256={_MODEL_NAME: hashlib.sha256(data).hexdigest(), **known},
        )

    # Only the graph is checked on open: the pool's WeightStore checks the weights it maps.
    entry = ensure_entry("models", key, build, cache=cache, verify=(_MODEL_NAME,))
    lend_hold(entry)
    return entry.file(_MODEL_NAME)


def relaxed_recipe(
    recipe: SessionRecipe, relaxed: Relaxed, plan_route: Callable[[Path], SessionRecipe]
) -> SessionRecipe:
    """The route of the relaxed graph, planned as ``recipe`` was, naming the same source.

    Args:
        recipe: The route planned for the model as given (``recipe.model_path``: its
            prepared graph, which :func:`relax` was given).
        relaxed: :func:`relax` of that graph, with something changed.
        plan_route: Plans a route for a model path with the pool's settings.
    """
    path = relaxed_model_for(recipe.model_path, relaxed, cache=Cache.at(recipe.cache))
    return dataclasses.replace(plan_route(path), source_path=recipe.source_path)

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

- a ``value_info`` or output of the main graph keeps its declared shape only where every dim is
  proven: a size the analysis computed (never a size on the rows' axis, which is N), or a name
  that stands for one proven size wherever the main graph's declarations use it (a name is what
  ORT equates dims by). A ``value_info`` that is not is dropped (ORT infers it again, from the
  inputs); an output loses the dims that are not, a rows' axis becoming :data:`ROWS_DIM`;
- subgraphs (``If``/``Loop``/``Scan`` bodies) declare nothing: no ``value_info`` and no input or
  output shape (two branches may define one name, and a loop body's facts hold for the rounds
  the analysis followed), but for a ``Loop`` body's iteration number and condition, scalars by
  the operator's definition (ORT's ``Loop`` needs them);
- the graph's inputs keep their shapes (requests are checked against them), but for an axis 0
  fixed at 1 where the analysis ran in its ``fixed_rows`` mode (models exported with axis 0
  fixed at 1, served batched with that axis relaxed): it becomes :data:`ROWS_DIM`.

Where nothing changes, the pool loads the prepared graph itself. Otherwise the copy is a
``models`` cache entry of its own (:func:`relaxed_model_for`), keyed by the relaxed graph's
bytes. Its weights files are hard links to the prepared model's where that is a file of the
cache (the same inodes, so the weights are still mapped once per process), and copies where
the caller prepared the model (a second link would change the caller's file; the pool maps only
the copy). Every route (ORT's optimized and prepacked forms included) is built from it. The
model the caller gave is never written. Requests are still checked against the source's shapes
(one row each, for a model fixed at 1).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
from pathlib import Path
from typing import Any

from sharedml._errors import NotBatchableError
from sharedml.cache._entries import Built, ensure_entry
from sharedml.cache._locks import lend_hold
from sharedml.cache._root import Cache
from sharedml.model._graph import external_locations
from sharedml.model._proto import AttributeProto, GraphProto, ModelProto
from sharedml.prepared._format import read_manifest
from sharedml.route._planner import OpenedModel
from sharedml.rows import ONE, Dim, Fact, Kind, RowAnalysis
from sharedml.weights._store import WeightStore

__all__ = [
    "ROWS_DIM",
    "Relaxed",
    "fixed_row_inputs",
    "relax",
    "relaxed_graph",
    "relaxed_model_for",
    "relaxed_model",
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
    graph = relaxed.graph
    batch_params = analysis.batch_params
    rows_dim = _rows_dim(graph, batch_params)
    top = analysis.top_facts
    once = _consistent_names(graph, top, analysis.facts)
    kept = []
    for value in graph.value_info:
        fact = top.get(value.name)
        tensor = value.type.tensor_type if value.type.HasField("tensor_type") else None
        if fact is None and value.name not in analysis.facts:
            kept.append(value)  # a value no graph of the model has: it declares nothing
        elif fact is not None and tensor is not None and _proven(tensor, fact, batch_params, once):
            kept.append(value)
        else:
            changed.append(value.name)
    del graph.value_info[:]
    graph.value_info.extend(kept)
    for node in graph.node:
        _undeclare_subgraphs(node, changed)
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
            _keep_proven(value.type.tensor_type, fact, batch_params, rows_dim, once)
        if value.type.SerializeToString() != before:
            changed.append(value.name)
    if not fixed and not changed:
        return Relaxed(model, (), False)
    return Relaxed(relaxed, tuple(changed), fixed)


def relaxed_graph(model: ModelProto, analysis: RowAnalysis) -> ModelProto:
    """The graph of :func:`relax`: what a batching pool's sessions load."""
    return relax(model, analysis).graph


def _undeclare_subgraphs(node: Any, changed: list[str]) -> None:
    """Drop every shape ``node``'s subgraphs declare, at any depth (``value_info``, I/O).

    Below the main graph nothing is kept: two branches may define one name, and a loop body's
    facts hold for the rounds the analysis followed, not for every iteration.
    """
    body = node.op_type == "Loop" and node.domain in ("", "ai.onnx")
    for attr in node.attribute:
        subs = [attr.g] if attr.type == AttributeProto.GRAPH else []
        if attr.type == AttributeProto.GRAPHS:
            subs = list(attr.graphs)
        for sub in subs:
            changed.extend(v.name for v in sub.value_info)
            del sub.value_info[:]
            for inner in sub.node:
                _undeclare_subgraphs(inner, changed)
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


def _keep_proven(
    tensor: Any, fact: Fact, batch_params: frozenset[str], rows_dim: str, once: frozenset[str]
) -> None:
    """Keep the dims of a graph output's declared shape that ``fact`` proves; forget the rest."""
    if not tensor.HasField("shape"):
        return
    dims = tensor.shape.dim
    if not fact.rows or fact.shape is None or len(fact.shape) != len(dims):
        tensor.ClearField("shape")  # not even the rank is proven
        return
    for axis, (dim, proven) in enumerate(zip(dims, fact.shape, strict=True)):
        if _proves(fact, axis, proven, dim, batch_params, once):
            continue
        dim.Clear()
        if axis == fact.axis and fact.fold == ONE:
            dim.dim_param = rows_dim


def _proven(tensor: Any, fact: Fact, batch_params: frozenset[str], once: frozenset[str]) -> bool:
    """Whether every dim of a ``value_info``'s declared shape is one ``fact`` proves."""
    if not tensor.HasField("shape"):
        return True
    dims = tensor.shape.dim
    if fact.kind is Kind.MIXED or fact.shape is None or len(fact.shape) != len(dims):
        return False
    return all(
        _proves(fact, axis, proven, dim, batch_params, once)
        for axis, (dim, proven) in enumerate(zip(dims, fact.shape, strict=True))
    )


def _proves(
    fact: Fact,
    axis: int,
    proven: Dim,
    dim: Any,
    batch_params: frozenset[str],
    consistent: frozenset[str],
) -> bool:
    """Whether a declared dim says nothing that ``proven`` (axis ``axis`` of ``fact``) denies.

    A size must be the one computed (and never on the rows' axis, whose size is N); a name
    must stand for one proven size wherever the main graph's declarations use it
    (``consistent``): ORT equates the dims one name names, so that is all a name claims.
    """
    if dim.HasField("dim_value"):
        if dim.dim_value < 0:
            return True  # Paddle writes -1 for dynamic, as ORT reads it
        return not (fact.rows and axis == fact.axis) and bool(proven.const == dim.dim_value)
    param = dim.dim_param if dim.HasField("dim_param") else ""
    return not param or param in consistent


def _consistent_names(
    graph: GraphProto, top: dict[str, Fact], anywhere: dict[str, Fact]
) -> frozenset[str]:
    """The dim names of the main graph's declarations that stand for one proven size each.

    An input's dims are what requests give (N on axis 0); a value's, what the analysis computed
    for it. A name used where the analysis knows no size, or for two sizes it cannot prove
    equal (two opaque sizes, a size and N), is not consistent.
    """
    sizes: dict[str, set[Dim]] = {}
    unknown: set[str] = set()
    for value in (*graph.input, *graph.output, *graph.value_info):
        if not value.type.HasField("tensor_type"):
            continue
        fact = top.get(value.name)
        if fact is None and value.name not in anywhere:
            continue  # a value no graph of the model has: ORT ignores its declaration
        dims = value.type.tensor_type.shape.dim
        shape = fact.shape if fact is not None else None
        for axis, d in enumerate(dims):
            if not (d.HasField("dim_param") and d.dim_param):
                continue
            if shape is not None and len(shape) == len(dims):
                sizes.setdefault(d.dim_param, set()).add(shape[axis])
            else:
                unknown.add(d.dim_param)
    return frozenset(name for name, found in sizes.items() if len(found) == 1) - unknown


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

    # A file of the cache (a model the pool prepared) is hard-linked: the same inode, mapped
    # once. A file of the caller's is copied, never linked: a second link would change it for
    # its owner (onnx.load refuses external data with more than one link, "a potential
    # hardlink attack"), and the pool maps only the copy, so still once.
    own = _inside(prepared, cache.root)

    def build(folder: Path) -> Built:
        for location in locations:
            source, target = prepared.parent / location, folder / location
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                if own:
                    os.link(source, target)
                else:
                    shutil.copyfile(source, target)
            except OSError as exc:
                raise NotBatchableError(
                    f"The weights file '{source}' cannot be "
                    + ("hard-linked" if own else "copied")
                    + f" into the cache ({exc.strerror or exc}), so the model cannot get the "
                    "graph that batching needs without a second copy of its weights in memory. "
                    "Put the cache (SHAREDML_CACHE_DIR) on the model's file system, or run it "
                    "without batching (batching=False)."
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


def relaxed_model(opened: OpenedModel, relaxed: Relaxed, *, verify: bool) -> OpenedModel:
    """The relaxed graph as the model the pool routes, naming the same source; not parsed.

    The graph is :func:`relax`'s, in memory: its entry is written from it, and the weights
    store and everything after it read this very message, never the file written.

    Args:
        opened: The model as given, opened (``opened.graph``: its prepared graph, which
            :func:`relax` was given).
        relaxed: :func:`relax` of that graph, with something changed.
        verify: Check the weights' SHA-256 when first mapped (hard links of files checked
            already are the same mapping: not read again).
    """
    path = relaxed_model_for(opened.model_path, relaxed, cache=opened.cache)
    weights = WeightStore.open(path, verify=verify, cache_dir=opened.cache, model=relaxed.graph)
    return dataclasses.replace(opened, model_path=path, graph=relaxed.graph, weights=weights)


def _inside(path: Path, root: Path) -> bool:
    """Whether ``path`` lies in the folder ``root`` (both resolved)."""
    try:
        path.resolve().relative_to(root.resolve())
    except ValueError:
        return False
    return True

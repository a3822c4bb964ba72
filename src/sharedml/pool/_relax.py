"""Models exported with axis 0 fixed at 1, served batched with that axis relaxed.

Many exporters trace a model at one row and write ``[1, 3, 224, 224]`` for its input and
``[1, 1000]`` for its output: ONNX Runtime then refuses any other row count, so such a model
cannot merge requests as it is. Where the row-independence analysis
(:class:`~sharedml.pool._rows.RowAnalysis` with ``fixed_rows``) proves that the graph holds each
row apart for any row count, and that no constant of the graph ties axis 0 to 1 (a Reshape to
``[1, -1]``, an Expand or ConstantOfShape whose constant shape meets the rows, a Slice or Resize
to 1 on the rows' axis, ...), the pool serves it from a copy of its *prepared* graph whose rows'
axis is a symbolic dim instead (:func:`relaxed_graph`): the graph's inputs and outputs, and the
``value_info`` of every value that holds the rows. Values declared with the rows folded into
another size lose that dim (ONNX Runtime infers it again); declared shapes of values the
analysis did not reach, or that depend on the row count, are dropped.

The relaxed graph is a ``models`` cache entry of its own (:func:`relaxed_model_for`), keyed by
the prepared graph's bytes, whose weights files are hard links to the prepared model's: the
same files (and inodes), so the weights are still mapped once per process, and every route
(ORT's optimized and prepacked forms included) is built from the relaxed graph. The model the
caller gave is never written. Requests are still checked against the source's shapes (one row
each); merged runs hold several.
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
from sharedml.model._graph import external_locations, iter_graphs
from sharedml.model._proto import ModelProto
from sharedml.pool._rows import Fact, Kind, RowAnalysis
from sharedml.prepared._format import read_manifest
from sharedml.route._planner import SessionRecipe

__all__ = [
    "RELAXED_REASON",
    "ROWS_DIM",
    "fixed_row_inputs",
    "relaxed_graph",
    "relaxed_model_for",
    "relaxed_recipe",
]

ROWS_DIM = "sharedml_rows"
"""The symbolic dim a relaxed graph has on its rows' axis."""

RELAXED_REASON = (
    f"; the model fixes axis 0 at 1, so the sessions load its prepared graph with that axis "
    f"relaxed to '{ROWS_DIM}' (the model as given is unchanged)"
)
"""What ``pool.batching_reason`` adds for a model served relaxed."""

_KEY_PREFIX = b"sharedml relaxed rows 1\0"  # part of the entry's key: a new layout, a new key
_MODEL_NAME = "model.onnx"


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


def relaxed_graph(model: ModelProto, analysis: RowAnalysis) -> ModelProto:
    """A copy of ``model`` whose rows' axis is the symbolic dim :data:`ROWS_DIM`.

    Args:
        model: The prepared graph (external data not loaded).
        analysis: The analysis that proved ``model`` batchable (``refusal()`` is None), so
            that its ``facts`` cover every value it reached.
    """
    relaxed = ModelProto()
    relaxed.CopyFrom(model)
    facts = analysis.facts
    for graph, _depth in iter_graphs(relaxed.graph):
        for value in (*graph.input, *graph.output):
            fact = facts.get(value.name)
            if fact is not None and fact.rows:
                _relax_value(value, fact)
        kept = []
        for value in graph.value_info:
            fact = facts.get(value.name)
            if fact is None or fact.kind in (Kind.MIXED, Kind.SIZED):
                # Not proven, or sized by the row count (declared as traced at one row):
                # ONNX Runtime infers its shape itself.
                continue
            if fact.rows:
                _relax_value(value, fact)
            kept.append(value)
        if len(kept) != len(graph.value_info):
            del graph.value_info[:]
            graph.value_info.extend(kept)
    return relaxed


def _relax_value(value: Any, fact: Fact) -> None:
    """Make the rows' axis of a declared shape symbolic (unknown where the rows are folded)."""
    if not value.type.HasField("tensor_type") or not value.type.tensor_type.HasField("shape"):
        return
    dims = value.type.tensor_type.shape.dim
    if fact.axis >= len(dims):
        return
    dim = dims[fact.axis]
    dim.Clear()
    if fact.fold == 1:
        dim.dim_param = ROWS_DIM


def relaxed_model_for(
    prepared: Path, model: ModelProto, analysis: RowAnalysis, *, cache: Cache
) -> Path:
    """The relaxed form of the prepared model at ``prepared``, as a cache entry of its own.

    Args:
        prepared: The prepared model's path (its weights files beside it).
        model: Its graph, as loaded from ``prepared``.
        analysis: The ``fixed_rows`` analysis that proved it batchable.
        cache: The cache the pool's route was planned with.

    Raises:
        NotBatchableError: a weights file cannot be hard-linked into the cache (another file
            system): the weights would be copied, and mapped twice.
        CacheError: the cache fails sharedml's policy, or the entry cannot be published.
    """
    key = hashlib.sha256(_KEY_PREFIX + prepared.read_bytes()).hexdigest()
    manifest = read_manifest(model)
    known = {f.file: f.sha256 for f in manifest.files} if manifest is not None else {}
    # The manifest's files (a weights file with no tensor too: the store checks it) and any
    # other file a tensor names.
    locations = sorted(set(known) | external_locations(model.graph))

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
        data = relaxed_graph(model, analysis).SerializeToString()
        (folder / _MODEL_NAME).write_bytes(data)
        return Built(
            meta={"source": str(prepared), "relaxed": f"axis 0 fixed at 1 -> '{ROWS_DIM}'"},
            # The weights' digests as the manifest records them (the store checks them).
            sha256={_MODEL_NAME: hashlib.sha256(data).hexdigest(), **known},
        )

    # Only the graph is checked on open: the pool's WeightStore checks the weights it maps.
    entry = ensure_entry("models", key, build, cache=cache, verify=(_MODEL_NAME,))
    lend_hold(entry)
    return entry.file(_MODEL_NAME)


def relaxed_recipe(
    recipe: SessionRecipe,
    model: ModelProto,
    analysis: RowAnalysis,
    plan_route: Callable[[Path], SessionRecipe],
) -> SessionRecipe:
    """The route of the relaxed graph, planned as ``recipe`` was, naming the same source.

    Args:
        recipe: The route planned for the model as given (``recipe.model_path``: its
            prepared graph, ``model``).
        model: That graph.
        analysis: The ``fixed_rows`` analysis that proved it batchable.
        plan_route: Plans a route for a model path with the pool's settings.
    """
    relaxed = relaxed_model_for(recipe.model_path, model, analysis, cache=Cache.at(recipe.cache))
    return dataclasses.replace(plan_route(relaxed), source_path=recipe.source_path)

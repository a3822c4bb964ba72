"""Dynamic batching: requests that wait for a session are merged along axis 0 into one Run.

The pool (:mod:`sharedml.pool._pool`) decides *when* requests merge (the ones queued while every
session was busy, oldest first); this module decides *whether* they may and *how*:

- A model is batchable when axis 0 of every input is dynamic and the row-independence
  analysis (:mod:`sharedml.rows`) proves that every output's axis 0 holds one entry per input
  row, computed from that row alone: no node combines values across rows (a batch statistic,
  a Softmax over axis 0, a time-major RNN, dynamic quantization's one scale per tensor, ...).
  :func:`signature_of` refuses other models with :class:`~sharedml.NotBatchableError`, naming
  the node, its op type, the input its rows came from and why, and the opt-in
  (``Batching(rows_independent=True)``) for a caller who knows better.
- Every request is validated against the signature before it is merged (names, dtype, rank,
  fixed dimensions), so a bad request fails alone, with :class:`~sharedml.InvalidInputError`.
- Requests merge when they have the same input names, dtypes and non-batch dimensions, the same
  ``output_names``, and no ``run_options`` (or the very same ``RunOptions`` object). A request
  of zero rows never merges and is never padded: it runs alone, as an unbatched run would.
- Outputs are split back by rows into arrays each caller owns. An output whose axis 0 does not
  have the merged row count at run time means the model is not batch-consistent after all: the
  members are run one by one instead (and the pool stops merging after repeated evidence).
- :func:`same_results` compares a merged run's rows with solo runs of the same requests: the
  pool's check of its first merged batches (defence in depth behind the analysis).

What merging costs in accuracy: kernels may pick another blocking for another batch size, so
outputs can differ from a solo run in the last bits of float precision (``docs/batching.md``).
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import functools
import itertools
import math
import numbers
import operator
import random
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from sharedml._errors import InvalidInputError, NotBatchableError
from sharedml.model import _dtypes

if TYPE_CHECKING:
    from sharedml.rows import RowAnalysis

__all__ = [
    "ADAPTIVE_DELAY_SHARE",
    "CONVOLUTION_OPS",
    "MAX_COUNT",
    "MAX_DELAY_MS",
    "Batching",
    "BatchingDefault",
    "BatchingSetting",
    "CheckKind",
    "CheckSchedule",
    "Request",
    "Signature",
    "UNTOLD_GAP",
    "blank_feed",
    "bucket_for",
    "isolated",
    "merge",
    "same_feed",
    "same_results",
    "signature_of",
    "split",
    "tells",
]

# With Batching(max_delay_ms=None): the most a session waits for the rows it expects, as a share
# of the latest batch's run time. Waiting costs the rows already there at most this share of a
# run when the expected rows do not come; when they come, the batch runs them all at once.
ADAPTIVE_DELAY_SHARE = 0.5

# The longest Batching.max_delay_ms: a batch that waits longer for rows is a mistake (and past
# threading.TIMEOUT_MAX a lock's wait overflows).
MAX_DELAY_MS = 60_000.0  # milliseconds: a minute

# The largest Batching.max_batch_size and check_within: far past any batch worth merging, and
# small enough that buckets and schedules stay small numbers.
MAX_COUNT = 1 << 20

# Ops whose CUDA kernels keep cuDNN plans for the last input shape only (conv.cc,
# conv_transpose.cc, contrib FusedConv/NhwcConv): a new batch size rebuilds them.
CONVOLUTION_OPS = frozenset(("Conv", "ConvTranspose", "FusedConv", "NhwcConv"))


@dataclasses.dataclass(frozen=True)
class Batching:
    """How a pool merges waiting requests (``SessionPool(batching=...)``).

    Attributes:
        max_batch_size: The most rows (summed over axis 0 of the merged requests) in one Run.
        max_delay_ms: How long a session that found fewer rows waiting than it could run
            waits for more before it runs. ``None`` (default): adaptive. A session waits for as
            many rows as the pool's latest batch had, for at most half that batch's run time
            (``ADAPTIVE_DELAY_SHARE``); it never waits after a lone request, so an idle pool
            adds no latency. Callers that loop on the pool (a closed loop: each sends its next
            request when its result is back) then meet in one batch instead of alternating
            between a lone run and the rest. A number: wait up to that many milliseconds for
            ``max_batch_size`` rows. 0: never wait; batches form only from the requests that
            queued while every session was busy.
        pad_to_buckets: Pad each batch (a lone request too) to the next power of two rows
            (at most ``max_batch_size``), repeating its last row; the padding's outputs are
            dropped. None (default): on for every provider but the CPU's, and always with CUDA
            graphs. GPU providers choose kernels per input shape (cuDNN searches convolution
            algorithms for each new batch size, a CUDA graph is captured per shape): buckets
            bound the shapes to ``log2(max_batch_size) + 1``, which ``warm_up`` then settles.
            On the CPU kernels need no warm-up per shape, and padding would only cost work.
        session_per_bucket: Give every bucket an ONNX Runtime session of its own, with the
            batch dim fixed (the pool's sessions then hold one per bucket, all lent the same
            weights). None (default): on where batches are padded on a CUDA device without
            CUDA graphs, for models with convolutions. ORT's CUDA ``Conv`` keeps the cuDNN
            plans of the last input shape only and rebuilds them whenever the shape changes,
            so one session fed batches of alternating sizes rebuilds every convolution's
            plans at almost every batch. Each extra session costs its activation memory, and
            models without convolutions gained no speed for it, so they keep one session for
            every batch size (figures: ``docs/batching.md``, padding and buckets). Needs the
            batch dim to be named (``dim_param``), else the pool's own sessions run every
            shape.
        share_rows: With several sessions and the adaptive delay, split the rows in play
            evenly over the sessions that batch (the rows their latest batches had, or more
            where more are held and queued), so that their batches run side by side instead
            of one session taking every waiting row while the others idle. None (default): on
            for every provider but the CPU's, never when runs are serialized. A GPU runs each
            session's batch in a stream of its own, so shared rows measured faster there; on
            the CPU the sessions' batches compete for the same cores, and one batch of all the
            rows measured faster (figures: ``docs/batching.md``, the policy).
        copy_outputs: Give each caller arrays of its own, copied out of the batch's outputs
            (in the caller's thread, after the session went back). False: each caller's
            outputs are views of the batch's output arrays, which saves copying every output
            once. A view covers the caller's rows only, and so does everything it leads to:
            its ``.base`` is an object whose ``__array_interface__`` spans those rows, with no
            reference to the batch's array (writes, ``.base``, pickling and buffer exports
            never reach another caller's rows). The batch's output (``max_batch_size`` times
            a request's bytes at most) stays alive, held by sharedml, until every caller's
            views are gone. Outputs of strings are copied. A run that was not merged returns
            ORT's arrays either way.
        rows_independent: Take the caller's word that every output row depends only on its own
            input row, and merge without the row-independence analysis (for a model it cannot
            prove, e.g. one with a custom operator). The pool still checks merged batches
            against solo runs (``check_within``) and stops merging on a mismatch. False
            (default): merge only models the analysis proves.
        check_within: The most merged batches of different requests, in one class of batches
            (the requests' input signature and the batch's power-of-two row bucket), from one
            check against solo runs to the next: a leak of rows between callers that shows in
            a class's batches is found within this many of them, whatever the first requests
            were (``docs/batching.md``, defence in depth, has the schedule and its cost). The
            first merged batch of every class is checked, then batches at random gaps that
            grow to this bound. None: check each class only until a batch that could show a
            leak has passed (the first batches of a class), then never again.
        measure_gain: Compare merged batches' ``Run`` time with solo runs of their requests
            on the same session, and pause merging where it gains too little to pay for
            itself (a batch of n rows costing about n single rows: convolutions on a few
            cores), trying again later with hysteresis (:mod:`sharedml.pool._payoff`;
            ``stats().merge_gain``, ``batching_reason``). False: merge whatever it gains.
        required: True (default): a model the row-independence analysis cannot prove
            batchable raises ``NotBatchableError``. False: such a model is served unbatched
            and ``batching_reason`` says why, as ``batching="auto"`` does with the default
            settings; ``Batching(required=False, ...)`` is ``"auto"`` with other settings.
    """

    max_batch_size: int = 32
    max_delay_ms: float | None = None
    pad_to_buckets: bool | None = None
    session_per_bucket: bool | None = None
    share_rows: bool | None = None
    copy_outputs: bool = True
    rows_independent: bool = False
    check_within: int | None = 64
    measure_gain: bool = True
    required: bool = True

    def __post_init__(self) -> None:
        # Every field is checked here, so that a bad setting fails where it is written, not
        # at the first run (a delay of 1e300 ms once overflowed the lock's timeout there).
        object.__setattr__(
            self, "max_batch_size", _count("max_batch_size", self.max_batch_size, "rows")
        )
        delay: object = self.max_delay_ms
        if delay is not None:
            ms = math.nan
            if isinstance(delay, (bool, np.bool_)):
                pass  # True is no number of milliseconds
            elif isinstance(delay, numbers.Real):
                ms = float(delay)
            if not (math.isfinite(ms) and 0 <= ms <= MAX_DELAY_MS):
                raise ValueError(
                    f"Batching(max_delay_ms={delay!r}): max_delay_ms must be None (adaptive) or "
                    f"a number of milliseconds from 0 to {MAX_DELAY_MS:g} (a minute); a batch "
                    "that waits longer for rows is a mistake."
                )
            object.__setattr__(self, "max_delay_ms", ms)
        for name in ("pad_to_buckets", "session_per_bucket", "share_rows"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (bool, np.bool_)):
                raise ValueError(
                    f"Batching({name}={value!r}): {name} must be True, False or None "
                    "(the provider's default)."
                )
            object.__setattr__(self, name, None if value is None else bool(value))
        for name in ("copy_outputs", "rows_independent", "measure_gain", "required"):
            value = getattr(self, name)
            if not isinstance(value, (bool, np.bool_)):
                raise ValueError(f"Batching({name}={value!r}): {name} must be True or False.")
            object.__setattr__(self, name, bool(value))
        if self.check_within is not None:
            object.__setattr__(
                self,
                "check_within",
                _count("check_within", self.check_within, "merged batches", none="or None"),
            )

    def pads(self, provider: str, *, cuda_graphs: bool = False) -> bool:
        """Whether batches on ``provider`` are padded to buckets (see ``pad_to_buckets``)."""
        if cuda_graphs:
            return True  # a graph per batch size otherwise
        if self.pad_to_buckets is None:
            return provider != "CPUExecutionProvider"
        return self.pad_to_buckets

    def shares_rows(self, provider: str, *, serialized: bool = False) -> bool:
        """Whether sessions split the rows in play under the adaptive delay (``share_rows``)."""
        if self.max_delay_ms is not None or serialized:
            return False
        if self.share_rows is None:
            return provider != "CPUExecutionProvider"
        return self.share_rows

    def sessions_per_bucket(
        self, provider: str, *, cuda_graphs: bool = False, convolutions: bool = True
    ) -> bool:
        """Whether each bucket gets a session of its own (see ``session_per_bucket``).

        Never with CUDA graphs, which fix the dims per graph already; only where batches are
        padded (else every batch size would be a session). ``convolutions``: whether the
        model has any (``Signature.convolutions``); the default needs them.
        """
        if cuda_graphs or not self.pads(provider):
            return False
        if self.session_per_bucket is None:
            return provider == "CUDAExecutionProvider" and convolutions
        return self.session_per_bucket

    def buckets(self) -> list[int]:
        """The rows a padded batch can have: the powers of two below ``max_batch_size``, and it."""
        sizes, size = [], 1
        while size < self.max_batch_size:
            sizes.append(size)
            size *= 2
        return [*sizes, self.max_batch_size]

    @classmethod
    def parse(cls, value: object) -> Batching | Literal["auto"] | None:
        """A ``batching=`` argument, one meaning per spelling, as everywhere in sharedml.

        ``True`` -> the defaults, ``False`` -> None (no batching), a Batching -> itself,
        ``"auto"`` -> ``"auto"`` (merge wherever the row-independence analysis proves the model
        batchable, which only a pool that has the model can decide).

        Raises:
            ValueError: any other value.
        """
        if value is False:
            return None
        if value is True:
            return cls()
        if value == "auto" and isinstance(value, str):
            return "auto"
        if isinstance(value, cls):
            return value
        # None once meant "left out" to a pool and False here: it now means neither.
        none = " (False: no batching; leave the argument out for the pool's default)"
        raise ValueError(
            f"batching must be 'auto', True, False or a sharedml.Batching, not {value!r}"
            f"{none if value is None else ''}."
        )


def _count(name: str, value: object, unit: str, *, none: str = "") -> int:
    """A Batching field that counts something: an integer from 1 to ``MAX_COUNT``."""
    try:
        count = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        count = 0
    if isinstance(value, (bool, np.bool_)) or not 1 <= count <= MAX_COUNT:
        raise ValueError(
            f"Batching({name}={value!r}): {name} must be an integer from 1 to {MAX_COUNT:,} "
            f"({unit}){' ' + none if none else ''}."
        )
    return count


BatchingSetting = bool | Batching | Literal["auto"]
"""What ``batching=`` takes, with one meaning per spelling (:meth:`Batching.parse`): ``"auto"``
merges wherever the row-independence analysis proves the model batchable (``batching_reason``
says why not), ``True`` the defaults of :class:`Batching` (or ``NotBatchableError``), a
``Batching`` its settings (``NotBatchableError`` unless ``required=False``), ``False``
never."""


class BatchingDefault(enum.Enum):
    """The mark of a ``batching=`` left out: each API's own default applies.

    ``SessionPool``'s: ``"auto"`` where the provider runs one ``Run`` at a time (DirectML),
    else ``False``.
    """

    BY_PROVIDER = "by-provider"


@dataclasses.dataclass(frozen=True)
class _Input:
    name: str
    type: str
    dtype: Any  # numpy dtype, or None for types batching cannot check
    shape: tuple[int | None, ...] | None  # None entries: dynamic; None: no shape known

    @functools.cached_property
    def accepts(self) -> tuple[Any, int, tuple[tuple[int, int], ...]] | None:
        """What an array passes unchecked: (its dtype, rank, fixed (axis, size)s); None: none.

        Every request checks its arrays against this first, with no conversion and no
        message built: a caller's validation runs on the event loop for every async request,
        16 times between two batches of 16 callers. Anything else goes through ``_check``.
        """
        if self.dtype is None or self.shape is None:
            return None
        fixed = tuple((axis, size) for axis, size in enumerate(self.shape) if size is not None)
        return np.dtype(self.dtype), len(self.shape), fixed


@dataclasses.dataclass(frozen=True)
class Signature:
    """A model's inputs and outputs as a batching pool checks requests against them.

    Attributes:
        inputs: By name, in the model's order.
        outputs: Output names, in order.
        convolutions: Whether any graph of the model has a convolution (``CONVOLUTION_OPS``),
            which decides ``Batching.session_per_bucket``'s default.
        proof: The row-independence analysis that proved the model batchable (None where
            the caller's word was taken, ``Batching.rows_independent``). Its sessions load the
            graph it proved (:func:`sharedml.pool._relax.relax`): one that declares no shape
            the analysis did not prove.
    """

    inputs: Mapping[str, _Input]
    outputs: tuple[str, ...]
    convolutions: bool = False
    proof: RowAnalysis | None = None

    @property
    def relaxed(self) -> bool:
        """Whether the model fixes axis 0 at 1 and is served with that axis relaxed.

        Requests are still checked against the model's own shapes (one row each).
        """
        return self.proof is not None and self.proof.fixed_rows

    def request(
        self,
        output_names: Sequence[str] | None,
        feed: Mapping[str, Any],
        run_options: Any | None,
    ) -> Request:
        """Validate one request and put it in the form the pool merges.

        Only what an unbatched run would refuse is refused; anything else that cannot merge
        (inputs of different batch sizes, lists, scalars, device tensors) runs alone.

        Raises:
            InvalidInputError: a missing or unknown input, or an array whose dtype, rank or
                fixed dimensions differ from the model's.
        """
        missing = unknown = None
        if feed.keys() != self.inputs.keys():
            missing = [n for n in self.inputs if n not in feed]
            unknown = [n for n in feed if n not in self.inputs]
        if missing or unknown:
            parts = []
            if missing:
                parts.append(f"missing input(s) {', '.join(map(repr, missing))}")
            if unknown:
                parts.append(f"unknown input(s) {', '.join(map(repr, unknown))}")
            raise InvalidInputError(
                f"The feed has {' and '.join(parts)}; the model's inputs are "
                f"{', '.join(map(repr, self.inputs))}."
            )
        arrays: dict[str, Any] = {}
        rows: int | None = None
        mergeable = True
        key_parts: list[Any] = []
        for name, spec in self.inputs.items():
            value = feed[name]
            arrays[name] = value
            if not isinstance(value, np.ndarray):
                # A list, a scalar, an OrtValue: ORT converts and checks it; it runs alone.
                mergeable = False
                continue
            accepts, shape, dtype = spec.accepts, value.shape, value.dtype
            passes = False
            if accepts is not None and dtype == accepts[0] and len(shape) == accepts[1]:
                passes = True
                for axis, size in accepts[2]:
                    if shape[axis] != size:
                        passes = False
                        break
            if not passes:
                self._check(spec, value)  # raises, naming what differs, or lets it through
            if value.ndim == 0:
                mergeable = False
                continue
            if rows is None:
                rows = int(value.shape[0])
            elif rows != int(value.shape[0]):
                mergeable = False  # ORT may broadcast such inputs; batching must not merge them
            key_parts.append((name, dtype, shape[1:]))
        outputs = tuple(output_names) if output_names is not None else None
        key: Any = None
        if mergeable and rows is not None:
            key = (tuple(key_parts), outputs, id(run_options) if run_options is not None else None)
        if not rows:
            key = None  # zero rows: nothing to merge or pad; it runs alone, as ORT would
        return Request(outputs, arrays, run_options, rows or 0, key)

    @staticmethod
    def _check(spec: _Input, value: np.ndarray) -> None:
        strings = spec.dtype is np.object_ and value.dtype.kind in "OUS"
        if spec.dtype is not None and value.dtype != spec.dtype and not strings:
            raise InvalidInputError(
                f"Input '{spec.name}' must be {spec.type} ({np.dtype(spec.dtype).name}), "
                f"not {value.dtype.name}."
            )
        if spec.shape is None:
            return
        if value.ndim != len(spec.shape):
            raise InvalidInputError(
                f"Input '{spec.name}' must have rank {len(spec.shape)} "
                f"(shape {_shape_text(spec.shape)}), not {value.ndim} (shape {value.shape})."
            )
        for axis, (want, got) in enumerate(zip(spec.shape, value.shape, strict=True)):
            if want is not None and want != got:
                raise InvalidInputError(
                    f"Input '{spec.name}' must have {want} on axis {axis} (shape "
                    f"{_shape_text(spec.shape)}), not {got} (shape {value.shape})."
                )


def _shape_text(shape: Sequence[int | None]) -> str:
    return "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"


def _value_info(value: Any) -> tuple[str, Any, tuple[int | None, ...] | None]:
    """(type text, numpy dtype or None, dims with None for dynamic) of a graph input/output."""
    tensor = value.type.tensor_type if value.type.HasField("tensor_type") else None
    if tensor is None:
        return value.type.WhichOneof("value") or "unknown", None, None
    try:
        dtype: Any = _dtypes.np_dtype(tensor.elem_type).type
    except Exception:
        dtype = None
    type_text = _dtypes.ort_type(tensor.elem_type)
    if dtype is not None and np.dtype(dtype).kind in "OSU":
        dtype = np.object_
    if not tensor.HasField("shape"):
        return type_text, dtype, None
    # A negative dim_value is not valid ONNX, but Paddle's exporter writes -1 for dynamic dims
    # (PP-OCR, PicoDet) and ORT accepts any size there: dynamic, as ORT treats it.
    dims = tuple(
        d.dim_value if d.HasField("dim_value") and d.dim_value >= 0 else None
        for d in tensor.shape.dim
    )
    return type_text, dtype, dims


@dataclasses.dataclass
class Request:
    """One caller's run, validated.

    Attributes:
        output_names: As given to ``run`` (None: every output).
        feed: The inputs, as numpy arrays where they can be merged.
        run_options: As given.
        rows: Its batch size (axis 0).
        key: Requests with equal keys merge; None runs alone.
    """

    output_names: tuple[str, ...] | None
    feed: dict[str, Any]
    run_options: Any
    rows: int
    key: Any


def signature_of(
    model: Any,
    *,
    name: str,
    rows_independent: bool = False,
    max_rows: int | None = None,
    relax: bool = False,
) -> Signature:
    """The batching signature of a model, or why it cannot be batched.

    Args:
        model: The model's ``onnx.ModelProto`` (external data not loaded).
        name: How messages name the model.
        rows_independent: Skip the row-independence analysis (the caller's word,
            ``Batching.rows_independent``); inputs are still checked.
        max_rows: The most rows a merged run will hold (default: ``Batching``'s default
            ``max_batch_size``).
        relax: Accept inputs whose axis 0 is fixed at 1 where the analysis proves that the
            graph holds the rows apart with that axis relaxed (``Signature.relaxed``; the
            caller then runs the relaxed graph, as it runs every proven one). Needs the
            analysis: ``rows_independent`` does not skip it for such a model.

    Raises:
        NotBatchableError: an input whose axis 0 is fixed (or that is a scalar), or a node
            that combines rows or that the analysis cannot prove keeps them apart (for an
            input fixed at 1 with ``relax``: the node that ties axis 0 to 1).
    """
    from sharedml.model._graph import iter_graphs
    from sharedml.rows import RowAnalysis

    initializers = {t.name for t in model.graph.initializer}
    inputs: dict[str, _Input] = {}
    bound = Batching.max_batch_size if max_rows is None else max_rows
    relaxed: RowAnalysis | None = None
    for value in model.graph.input:
        if value.name in initializers:
            continue  # IR < 4: an initializer listed as an input with a default
        type_text, dtype, dims = _value_info(value)
        if relax and dims and dims[0] == 1 and relaxed is None:
            relaxed = _relaxable(model, name, value.name, _shape_text(dims), bound)
        if dims and dims[0] == 1 and relaxed is not None:
            pass  # served relaxed; a request still holds one row
        elif dims is not None and (len(dims) == 0 or dims[0] is not None):
            what = "a scalar" if len(dims) == 0 else f"fixed at {dims[0]} on axis 0"
            raise NotBatchableError(
                f"Input '{value.name}' of {name} is {what} (shape {_shape_text(dims)}): batching "
                "merges requests along a dynamic axis 0 of every input. Run it without batching "
                "(batching=False)."
            )
        inputs[value.name] = _Input(value.name, type_text, dtype, dims)
    proof = relaxed
    if not rows_independent and relaxed is None:
        # No declared shape is trusted (exporters declare [] for unknown shapes, a batch-1
        # export declares [1, ...], and a declared [N, ...] proves nothing about the rows): the
        # analysis derives every layout from the inputs, and the sessions load a graph that
        # declares nothing else (pool/_relax).
        proof = RowAnalysis(model, max_rows=bound)
        refusal = proof.refusal()
        if refusal is not None:
            raise NotBatchableError(
                f"{name} cannot merge requests: {refusal.describe()}, so merged requests could "
                "hand one caller values computed from another caller's rows. Run it without "
                "batching (batching=False); if you know that every output row depends only on "
                "its own input row, say so with batching=sharedml.Batching(rows_independent=True)."
            )
    op_types = {node.op_type for g, _ in iter_graphs(model.graph) for node in g.node}
    return Signature(
        inputs,
        tuple(o.name for o in model.graph.output),
        convolutions=bool(op_types & CONVOLUTION_OPS),
        proof=proof,
    )


def _relaxable(model: Any, name: str, input_name: str, shape: str, bound: int) -> RowAnalysis:
    """The ``fixed_rows`` analysis of a model with input ``input_name`` fixed at 1 on axis 0.

    Raises:
        NotBatchableError: naming the node that ties axis 0 to 1 (or that mixes rows).
    """
    from sharedml.rows import RowAnalysis

    analysis = RowAnalysis(model, max_rows=bound, fixed_rows=True)
    refusal = analysis.refusal()
    if refusal is None and analysis.refused:
        # ORT runs every node, used or not: one that fails for more rows fails the run.
        refusal = analysis.refused[0]
    if refusal is not None:
        raise NotBatchableError(
            f"Input '{input_name}' of {name} is fixed at 1 on axis 0 (shape {shape}), and "
            f"serving it batched with that axis relaxed cannot be proven right: "
            f"{refusal.describe()}. Run it without batching (batching=False), or export it "
            "with a dynamic axis 0."
        )
    return analysis


def bucket_for(rows: int, limit: int) -> int:
    """The smallest power of two >= ``rows``, at most ``limit``: the rows of a padded batch."""
    bucket = 1
    while bucket < rows:
        bucket *= 2
    return min(bucket, max(limit, rows))


def merge(requests: Sequence[Request], *, rows: int | None = None) -> dict[str, Any]:
    """One feed holding every request's rows, in order (same key assumed).

    Args:
        requests: The requests, each of ``request.rows`` rows.
        rows: Pad to this many rows by repeating the last one (a real row, so that no model
            meets inputs it was never given: zeros can be an invalid token id or a 0/0).
    """
    first = requests[0].feed
    merged = {}
    for name in first:
        parts = [r.feed[name] for r in requests]
        total = sum(len(part) for part in parts)
        if rows is not None and rows > total:
            parts.append(np.repeat(parts[-1][-1:], rows - total, axis=0))
        merged[name] = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)
    return merged


def split(
    outputs: Sequence[Any],
    requests: Sequence[Request],
    *,
    rows: int | None = None,
    copy: bool = True,
) -> list[list[Any]] | None:
    """Each request's rows of ``outputs``, as arrays it owns; None if the rows do not add up.

    Args:
        outputs: A run's outputs over the merged feed.
        requests: The requests merged, in order.
        rows: The merged feed's rows, padding included (default: the requests' rows).
        copy: False: views of ``outputs`` instead of copies; :func:`owned` copies them later
            (the pool does so in each caller's own thread, after the session is free again).
    """
    total = sum(r.rows for r in requests)
    expected = total if rows is None else rows
    for out in outputs:
        if len(out) != expected:  # arrays (axis 0) and sequence outputs (lists) alike
            return None
    per_request: list[list[Any]] = []
    start = 0
    for request in requests:
        stop = start + request.rows
        part = [out[start:stop] for out in outputs]
        per_request.append(owned(part) if copy else part)
        start = stop
    return per_request


def same_results(merged: Sequence[Any], solo: Sequence[Any], *, rtol: float) -> bool:
    """Whether a request's rows of a merged run equal its solo run, up to float rounding.

    A merged run may pick other kernel blockings than a solo one, so floats may differ in their
    last bits; a row that took another caller's values differs by far more. Floats compare
    within ``rtol`` of the output's largest finite magnitude (NaN and inf where the solo run
    has them), in tensors and in sequence and map outputs alike (a scikit-learn classifier's
    ZipMap gives a list of {label: probability} dicts); everything else (shapes, dtypes,
    lengths, keys, integers, strings) exactly.
    """
    if len(merged) != len(solo):
        return False
    for m, s in zip(merged, solo, strict=True):
        if isinstance(m, np.ndarray) and isinstance(s, np.ndarray):
            if not _same_array(m, s, rtol=rtol):
                return False
            continue
        floats: list[tuple[float, float]] = []
        if not _same_structure(m, s, floats):
            return False
        if floats:
            got, want = np.array(floats).T  # float64 (complex128 for complex tensors)
            if not _same_array(got, want, rtol=rtol):
                return False
    return True


def _same_array(m: np.ndarray, s: np.ndarray, *, rtol: float) -> bool:
    if m.shape != s.shape or m.dtype != s.dtype:
        return False
    if m.dtype.kind not in "fc":
        return bool(np.array_equal(m, s))
    finite = np.isfinite(s)
    if not np.array_equal(finite, np.isfinite(m)) or not np.array_equal(
        m[~finite], s[~finite], equal_nan=True
    ):
        return False
    if finite.any():
        scale = float(np.max(np.abs(s[finite])))
        diff = float(np.max(np.abs(m[finite].astype(np.float64) - s[finite])))
        if diff > rtol * max(scale, np.finfo(s.dtype).tiny):
            return False
    return True


def _same_structure(m: Any, s: Any, floats: list[tuple[float, float]]) -> bool:
    """Whether ``m`` and ``s`` (a sequence or map output) match but for their floats.

    Lists, tuples and dicts must match in type, length and keys; tensors inside compare as
    :func:`_same_array` does on their own; floats are collected into ``floats`` as
    (merged, solo) pairs, so that the caller compares them against the whole output's scale.
    """
    if isinstance(s, (float, np.floating)):
        if not isinstance(m, (float, np.floating)):
            return False
        floats.append((float(m), float(s)))
        return True
    if isinstance(s, np.ndarray):
        if not isinstance(m, np.ndarray) or m.shape != s.shape or m.dtype != s.dtype:
            return False
        if m.dtype.kind not in "fc":
            return bool(np.array_equal(m, s))
        floats.extend(zip(m.ravel().tolist(), s.ravel().tolist(), strict=True))
        return True
    if isinstance(m, np.ndarray):
        return False
    if isinstance(s, dict):
        if not isinstance(m, dict) or m.keys() != s.keys():
            return False
        key_types = {k: type(k) for k in m}  # keys equal as values (1 == 1.0): types too
        return all(key_types[k] is type(k) and _same_structure(m[k], s[k], floats) for k in s)
    if isinstance(s, (list, tuple)):
        if type(m) is not type(s) or len(m) != len(s):
            return False
        return all(_same_structure(a, b, floats) for a, b in zip(m, s, strict=True))
    return type(m) is type(s) and bool(m == s)


# A class whose checks all passed without one that could have shown a leak (every other
# caller's rows blank: see blank_feed) is checked at least this often (merged batches of different
# requests), however many of them passed: priming a pool with harmless requests buys no gaps.
UNTOLD_GAP = 4

# Classes a schedule remembers (least recently batched dropped first). A dropped class is
# checked again at its next batch, as a new one: forgetting only adds checks.
_MAX_CLASSES = 4096

CheckKind = Literal["full", "spot"]
"""A check of a merged batch: ``"full"`` reruns every request alone, ``"spot"`` one of them."""


@dataclasses.dataclass
class _Class:
    due: int = 1  # merged batches of the class until the next check (<= 0: the next one)
    gap: int = 1  # the most merged batches from one check to the next, for now
    checked: bool = False  # a check of the class passed
    told: bool = False  # ... one that could have shown a leak


class CheckSchedule:
    """When a batching pool checks a merged batch against solo runs of its requests.

    Batches fall into classes: the requests' key (input names, dtypes and non-batch dims,
    output names) and the batch's row bucket (the power of two at or above its rows). A
    class's first merged batch gets a full check (every request rerun alone); after a check
    passes the next one comes at a random gap of 1 to ``gap`` merged batches, ``gap``
    doubling with every passed check up to ``within`` (a spot check: one request, picked at
    random, rerun alone). Until a check of the class passed that could have shown a leak
    (:func:`tells`), ``gap`` stays at most :data:`UNTOLD_GAP`. A batch of equal requests
    proves nothing and is not checked: the check that was due goes to the class's next batch.

    So a class's merged batches of different requests go at most ``within`` in a row
    unchecked, whatever the first requests were, and once a class is settled about
    ``2 / (within + 1)`` of its batches are checked. The gaps are random, so that a client
    cannot time its requests between checks.

    Args:
        within: The bound on the gaps (``Batching.check_within``); None: no check after the
            first that could have shown a leak passed.
        limit: The most rows a batch holds (``Batching.max_batch_size``), the last bucket.
        seed: Seeds the gaps and the spot checks' picks (tests); None: from the OS.

    Not thread-safe: the scheduler calls it with its lock held.
    """

    def __init__(self, within: int | None, *, limit: int, seed: int | None = None) -> None:
        self._within = within
        self._limit = limit
        self._rng = random.Random(seed)
        self._classes: collections.OrderedDict[Any, _Class] = collections.OrderedDict()

    def _class(self, key: Any, rows: int) -> _Class:
        name = (key, bucket_for(rows, self._limit))
        found = self._classes.get(name)
        if found is None:
            found = self._classes[name] = _Class()
            if len(self._classes) > _MAX_CLASSES:
                self._classes.popitem(last=False)
        else:
            self._classes.move_to_end(name)
        return found

    def due(self, key: Any, rows: int) -> CheckKind | None:
        """Count a merged batch of ``rows`` rows of requests keyed ``key``; its check if due."""
        found = self._class(key, rows)
        found.due -= 1
        if found.due > 0:
            return None
        return "spot" if found.checked else "full"

    def skipped(self, key: Any, rows: int) -> None:
        """A due check was not made (equal requests): the class's next batch gets it."""
        found = self._class(key, rows)
        found.due = min(found.due, 0)

    def passed(self, key: Any, rows: int, *, telling: bool) -> None:
        """A check of the class passed; ``telling``: one that could have shown a leak."""
        found = self._class(key, rows)
        found.checked = True
        found.told = found.told or telling
        if found.told and self._within is None:
            found.due = sys.maxsize  # settled: never again
            return
        cap = UNTOLD_GAP if self._within is None else self._within
        if not found.told:
            cap = min(cap, UNTOLD_GAP)
        found.gap = min(found.gap * 2, cap)
        found.due = self._rng.randint(1, found.gap)

    def pick(self, members: int) -> int:
        """The member of a batch of ``members`` requests that a spot check reruns."""
        return self._rng.randrange(members)


def blank_feed(feed: Mapping[str, Any]) -> bool:
    """Whether a request's rows could hide a leak: every input blank (:func:`_blank`).

    A leak hands a caller values computed from another caller's rows; rows that add nothing
    to a sum, a mean or an attention over positions (zeros, one value throughout, rows that
    sum to zero, every position the same) leave the caller's values as they were, so a check
    of a batch whose other rows are all such passes whether the model leaks or not.
    """
    return all(_blank(value) for value in feed.values())


def _blank(value: Any) -> bool:
    if not isinstance(value, np.ndarray) or value.dtype.kind not in "biufc":
        return False  # strings and the like: cannot tell, so taken as telling
    if value.size == 0:
        return True
    if value.ndim == 0 or np.all(value == value.flat[0]):
        return True  # zeros, or one value throughout
    wide = value.astype(np.complex128 if value.dtype.kind == "c" else np.float64)
    magnitude = np.abs(wide)
    # Sums within float rounding of zero: the whole request's, or each column's over its rows.
    if abs(wide.sum()) <= _ZERO_SUM * magnitude.sum():
        return True
    if len(value) > 1 and np.all(np.abs(wide.sum(axis=0)) <= _ZERO_SUM * magnitude.sum(axis=0)):
        return True
    if value.ndim >= 2:
        # Every position (all axes but the rows' and the features') holding the same vector:
        # a sequence of one repeated token, which an attention over positions cannot tell.
        positions = (
            value[:, :, None] if value.ndim == 2 else value.reshape(len(value), -1, value.shape[-1])
        )
        if positions.shape[1] > 1 and np.array_equal(
            positions, np.broadcast_to(positions[:, :1], positions.shape)
        ):
            return True
    return False


_ZERO_SUM = 1e-6  # a sum this small against the sum of magnitudes is zero, up to rounding


def tells(feeds: Sequence[Mapping[str, Any]], checked: Sequence[int]) -> bool:
    """Whether a check of the requests ``checked`` (indices into ``feeds``) could show a leak.

    It could where a checked request shares its batch with another that holds other values
    and is not blank (:func:`blank_feed`): that one's rows change what a leaking model hands
    the checked caller.
    """
    blank: dict[int, bool] = {}
    for i in checked:
        for j, other in enumerate(feeds):
            if j == i:
                continue
            if j not in blank:
                blank[j] = blank_feed(other)
            if not blank[j] and not same_feed(feeds[i], other):
                return True
    return False


def same_feed(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Whether two requests' feeds hold the same values (a check of them proves nothing)."""
    return a.keys() == b.keys() and all(
        np.array_equal(a[k], b[k]) if isinstance(a[k], np.ndarray) else a[k] is b[k] for k in a
    )


class _Rows:
    """One caller's rows of a batch's output array, as numpy sees them: address and shape only.

    An array made from it (``np.asarray``) has it as its ``.base``: the view of the caller's
    rows reaches no other caller's through ``.base``, ``__array_interface__`` or any Python
    reference. The batch's array is kept alive apart, in ``_HELD`` under ``token`` (a number,
    which leads nowhere), until this object goes: ``__del__``, not ``weakref.finalize``, which
    cost 3 of the 6 us a view took, paid per caller between two batches.
    """

    __slots__ = ("__array_interface__", "_token")

    def __init__(self, interface: dict[str, Any], token: int) -> None:
        self.__array_interface__ = interface
        self._token = token

    def __del__(self) -> None:
        _HELD.pop(self._token, None)  # one call: atomic under the GIL, from any thread


# The batch outputs that views handed out with copy_outputs=False still need, by token: held
# here rather than by the views, so that nothing a caller holds leads to other callers' rows.
_HELD: dict[int, Any] = {}
_TOKENS = itertools.count()


def isolated(part: Sequence[Any]) -> list[Any]:
    """A request's outputs from :func:`split` with ``copy=False``, as views of its rows alone.

    A plain slice of a batch's output has the whole output as its ``.base``: a caller who
    follows it reads every other caller's rows. Here each array is a view of the same memory
    (no copy) whose ``.base`` is a :class:`_Rows` spanning the caller's rows only; the batch's
    output stays alive until every caller's views are gone. Arrays of Python objects
    (strings) are copied instead; sequence outputs (lists) are already the caller's own.
    """
    views: list[Any] = []
    for out in part:
        if not isinstance(out, np.ndarray):
            views.append(out)
        elif out.dtype.hasobject:
            views.append(out.copy())  # object pointers: numpy's own copy holds their refs
        else:
            token = next(_TOKENS)
            _HELD[token] = out
            # __array_interface__ is a new dict each time, holding no reference to ``out``.
            views.append(np.asarray(_Rows(out.__array_interface__, token)))
    return views


def owned(part: Sequence[Any]) -> list[Any]:
    """A request's outputs from :func:`split` with ``copy=False``, as arrays of its own.

    A view would keep the whole batch's output alive for as long as any caller holds its
    rows; sequence outputs (lists) are already new lists.
    """
    return [out.copy() if isinstance(out, np.ndarray) else out for out in part]

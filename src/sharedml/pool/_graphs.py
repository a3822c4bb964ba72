"""CUDA graphs in a pool: fixed device buffers per shape, captured safely, replayed concurrently.

ORT's CUDA EP (``enable_cuda_graph=1``) runs a session's graph from device buffers bound by
IOBinding at fixed addresses: it runs normally a few times, captures the next run into a CUDA
graph, and replays it afterwards. Three facts of ORT's implementation (read from
``cuda_execution_provider.cc`` and ``cuda_graph.cc``) decide how a pool must drive it:

- The graph lives in the EP's *per-thread* context: a session run from another thread warms up
  and captures again, at a run the caller cannot see. So every graph session here is driven by
  one thread of its own (:class:`GraphSession`); requests are handed to it.
- Capture uses ``cudaStreamCaptureModeGlobal``: while one stream captures, a synchronizing call
  from any other thread (another session's replay ends with one) fails the capture with
  ``CUDA failure 900: operation not permitted when stream is capturing``. So the runs that
  may capture (the first :data:`CAPTURE_RUNS` runs of each new shape) hold a process-wide lock
  exclusively, and every replay holds it shared: captures never overlap other graph work of
  the process. Other CUDA work of the process (a torch model, a pool without graphs) is not
  covered: warm a graph pool up before such work starts (``pool.warm_up``).
- ORT refuses graph capture when any node is not on the CUDA EP, and with symbolic dims it
  places the shape arithmetic (``Shape`` -> ``Gather`` -> ``Range``/``Reshape`` chains, e.g. a
  transformer's position ids) on the CPU: "all compute graph nodes have not been partitioned to
  the CUDAExecutionProvider". Fixing the dims folds those chains away. So each set of dim
  values gets a session of its own, created with ``add_free_dimension_override_by_name``
  (cheap: the weights are shared; what a session adds is the execution state a captured graph
  holds anyway); its graphs are kept under graph ids (run option ``gpu_graph_id``): a new input
  shape gets its own slot (session, buffers, binding, graph id), up to ``max_graphs`` per pool
  session. With batching, the pool pads every batch to a power-of-two bucket
  (``Batching.pad_to_buckets``) so that a few graphs serve any batch size.

Feeds are copied into the slot's input buffers and outputs copied out; callers who keep their
data on the device use :meth:`GraphSession.slot` to get the buffers themselves.

The device can also be ORT's CPU device (``"cpu"``): everything but the capture then runs, so
that the machinery is tested on machines without a GPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from sharedml._errors import InvalidInputError, SharedMLError
from sharedml.model._inputs import UNNAMED_DIM
from sharedml.runtime._capabilities import probe_input, probe_model
from sharedml.runtime._providers import GRAPH_DEVICES, cuda_graphs_enabled, graphs_unavailable

__all__ = [
    "probe_iobinding",
    "CAPTURE_RUNS",
    "DEFAULT_MAX_GRAPHS",
    "GRAPH_DEVICES",
    "GRAPH_ID_KEY",
    "GraphLimitError",
    "GraphSession",
    "GraphSlot",
    "ShapeSessions",
    "cuda_graphs_enabled",
    "graphs_unavailable",
    "symbolic_dims",
]

GRAPH_ID_KEY = "gpu_graph_id"  # ORT's run config entry naming the graph a run uses
NO_GRAPH_ID = -1  # the graph id of a run that ORT runs without capturing or replaying
CAPTURE_RUNS = 4  # runs of a new slot under the exclusive lock: one outside any graph, then
# ORT's warm-up and capture (its second run of a graph id; one more for margin)
DEFAULT_MAX_GRAPHS = 8  # slots per session: each holds device buffers and a captured graph


class GraphLimitError(SharedMLError, ValueError):
    """A CUDA-graph session was given more distinct input shapes than it keeps graphs for."""


class _SharedExclusive:
    """Many holders share it (replays) or one holds it alone (a capture); captures go first."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._shared = 0
        self._exclusive = False
        self._waiting_exclusive = 0

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            while self._exclusive or self._waiting_exclusive:
                self._cond.wait()
            self._shared += 1
        try:
            yield
        finally:
            with self._cond:
                self._shared -= 1
                self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            self._waiting_exclusive += 1
            try:
                while self._exclusive or self._shared:
                    self._cond.wait()
            finally:
                self._waiting_exclusive -= 1
            self._exclusive = True
        try:
            yield
        finally:
            with self._cond:
                self._exclusive = False
                self._cond.notify_all()


CAPTURE_LOCK = _SharedExclusive()  # process-wide: see the module docstring
_NUMBERS = itertools.count()  # names the sessions' threads apart


def symbolic_dims(
    declared: Mapping[str, Sequence[Any]], shapes: Mapping[str, Sequence[int]]
) -> dict[str, int]:
    """The values that inputs of ``shapes`` give the ``declared`` shapes' symbolic dims.

    ``declared``: input name -> the model's shape (ints, dim names, None). Inputs not declared
    or of another rank are skipped: ORT's own error names them at the run.

    Raises:
        InvalidInputError: two inputs give one symbolic dim different values.
    """
    dims: dict[str, int] = {}
    for name, shape in shapes.items():
        want = declared.get(name)
        if want is None or len(want) != len(shape):
            continue
        for dim, value in zip(want, shape, strict=True):
            if not isinstance(dim, str) or dim == UNNAMED_DIM:
                continue
            if dims.setdefault(dim, value) != value:
                raise InvalidInputError(
                    f"Input '{name}' gives dim '{dim}' the value {value}, another input "
                    f"{dims[dim]}: inputs that share a symbolic dim must agree on it."
                )
    return dims


class ShapeSessions:
    """A pool session made of one ORT session per set of symbolic-dim values (graphs off).

    For batching on CUDA (``Batching.session_per_bucket``): ORT's CUDA ``Conv`` keeps the
    cuDNN plans of its last input shape only and rebuilds them (``CreateCudnnFeExecutionPlan``
    in ``conv.cc``) whenever the shape changes, so one session fed batches of alternating
    sizes pays that for every convolution at almost every batch. Here each shape keeps a
    session whose dims are fixed (``add_free_dimension_override_by_name``), created on first
    use (``pool.warm_up`` creates them all); all are lent the pool's weights. Shapes beyond
    ``max_shapes``, feeds that are not numpy arrays and inputs without named dims run on
    ``template``, a session of the model with its dims free.

    Args:
        template: A session of the model, dims free: runs what the others do not, and answers
            ``get_inputs``/``get_outputs``/...
        factory: ``factory(dims)`` creates a session with the symbolic dims ``dims`` fixed.
        max_shapes: The most sessions kept besides ``template``.

    Thread safety: ``run`` may be called from any thread.
    """

    def __init__(
        self, template: Any, factory: Callable[[Mapping[str, int]], Any], *, max_shapes: int
    ) -> None:
        self.template = template
        self.factory = factory
        self.max_shapes = max_shapes
        self._declared = {i.name: list(i.shape) for i in template.get_inputs()}
        self._sessions: dict[tuple[tuple[str, int], ...], Any] = {}
        self._lock = threading.Lock()

    @property
    def shapes(self) -> list[dict[str, int]]:
        """The dims of the sessions created so far, oldest first."""
        with self._lock:
            return [dict(key) for key in self._sessions]

    def run(
        self, output_names: Sequence[str] | None, feed: Mapping[str, Any], run_options: Any = None
    ) -> list[Any]:
        """``InferenceSession.run`` on the session for the feed's dims."""
        return list(self.session_for(feed).run(output_names, feed, run_options))

    def session_for(self, feed: Mapping[str, Any]) -> Any:
        """The session that runs inputs shaped like ``feed`` (created if new)."""
        if not all(isinstance(v, np.ndarray) for v in feed.values()):
            return self.template
        dims = symbolic_dims(self._declared, {k: v.shape for k, v in feed.items()})
        if not dims:
            return self.template
        key = tuple(sorted(dims.items()))
        with self._lock:
            sess = self._sessions.get(key)
            if sess is None:
                if len(self._sessions) >= self.max_shapes:
                    return self.template
                # Created under the lock: two callers of one new shape make one session.
                sess = self._sessions[key] = self.factory(dims)
            return sess

    def close(self) -> None:
        """Drop the sessions (the pool drops the template)."""
        with self._lock:
            self._sessions.clear()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.template, name)  # get_inputs, get_providers, ...


@dataclasses.dataclass
class GraphSlot:
    """The device buffers one captured graph reads and writes, for one input shape.

    Attributes:
        graph_id: The graph's id (run option ``gpu_graph_id``) in its session.
        dims: The symbolic dims fixed for its session (name -> value).
        inputs: Input name -> ``OrtValue`` on the device, at a fixed address.
        outputs: Output name -> ``OrtValue`` on the device, at a fixed address.
        rows: The batch (axis 0) the slot was captured for.
    """

    graph_id: int
    dims: dict[str, int]
    inputs: dict[str, Any]
    outputs: dict[str, Any]
    rows: int
    session: Any = dataclasses.field(repr=False, default=None)
    binding: Any = dataclasses.field(repr=False, default=None)
    run_options: Any = dataclasses.field(repr=False, default=None)


class GraphSession:
    """A pool session with CUDA graphs, driven by a thread of its own.

    Args:
        template: A session of the model (graphs off, never run): the inputs' declared shapes
            and everything ``get_inputs``/``get_outputs``/... report.
        factory: ``factory(dims)`` creates an ``onnxruntime.InferenceSession`` with
            ``enable_cuda_graph=1`` and the symbolic dims ``dims`` (name -> value) fixed.
        device: ``"cuda"`` (or ``"cpu"`` for tests of the machinery).
        device_id: The device.
        max_graphs: The most slots (distinct input shapes) kept.

    Thread safety: ``run`` and ``slot`` may be called from any thread; the work runs on the
    session's own thread.
    """

    def __init__(
        self,
        template: Any,
        factory: Callable[[Mapping[str, int]], Any],
        *,
        device: str,
        device_id: int,
        max_graphs: int = DEFAULT_MAX_GRAPHS,
    ) -> None:
        self.template = template
        self.factory = factory
        self.device = device
        self.device_id = device_id
        self.max_graphs = max_graphs
        self._slots: dict[Any, GraphSlot] = {}
        self._sessions: dict[tuple[tuple[str, int], ...], Any] = {}  # fixed dims -> session
        self._declared = {i.name: list(i.shape) for i in template.get_inputs()}
        self._outputs = [o.name for o in template.get_outputs()]
        self._thread = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=f"sharedml-graph-{next(_NUMBERS)}"
        )

    def run(self, output_names: Sequence[str] | None, feed: Mapping[str, Any]) -> list[Any]:
        """``InferenceSession.run``: feeds copied in, outputs copied out, replayed on the device."""
        return self._thread.submit(self._run_here, output_names, dict(feed)).result()

    def slot(self, feed: Mapping[str, Any]) -> GraphSlot:
        """The slot for inputs shaped like ``feed`` (example arrays), captured if new.

        For callers that keep their data on the device: write the inputs into
        ``slot.inputs`` (e.g. through their DLPack views), call :meth:`replay`, read
        ``slot.outputs``; nothing is copied through the host.
        """
        arrays = self._arrays(dict(feed))
        return self._thread.submit(self._slot_for, arrays).result()

    def replay(self, slot: GraphSlot) -> None:
        """Run the graph of ``slot`` on whatever its input buffers hold now."""
        self._thread.submit(self._replay, slot).result()

    def close(self) -> None:
        """Stop the session's thread (after the work it has); its sessions go with it."""
        self._thread.shutdown(wait=True)
        self._slots.clear()
        self._sessions.clear()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.template, name)  # get_inputs, get_providers, ...

    # Everything below runs on the session's own thread.

    def _run_here(self, output_names: Sequence[str] | None, feed: dict[str, Any]) -> list[Any]:
        arrays = self._arrays(feed)
        slot = self._slot_for(arrays)
        for name, array in arrays.items():
            slot.inputs[name].update_inplace(array)
        self._replay(slot)
        names = list(output_names) if output_names is not None else self._outputs
        outputs = [slot.outputs[n].numpy() for n in names]
        if self.device == "cpu":
            # numpy() of a CPU value is a view of the slot's buffer, which the next run of the
            # slot overwrites (from the device, numpy() copies).
            outputs = [o.copy() for o in outputs]
        return outputs

    @staticmethod
    def _arrays(feed: dict[str, Any]) -> dict[str, Any]:
        """Feeds as contiguous numpy arrays, the form a slot's buffers are written from."""
        arrays = {}
        for name, value in feed.items():
            if not isinstance(value, np.ndarray):
                raise InvalidInputError(
                    f"Input '{name}' of a CUDA-graph session must be a numpy array (it is "
                    f"copied into the graph's device buffer), not {type(value).__name__}."
                )
            arrays[name] = np.ascontiguousarray(value)
        return arrays

    def _slot_for(self, arrays: dict[str, Any]) -> GraphSlot:
        key = tuple(sorted((k, a.dtype.str, a.shape) for k, a in arrays.items()))
        slot = self._slots.get(key)
        if slot is None:
            if len(self._slots) >= self.max_graphs:
                shapes = ", ".join(f"{k}{list(s)}" for k, _, s in key)
                raise GraphLimitError(
                    f"A CUDA-graph session keeps at most {self.max_graphs} graphs (each holds "
                    f"its own device buffers); inputs {shapes} would need another. Use fewer "
                    "input shapes, pad to the shapes already captured, or batching (which pads "
                    "to power-of-two buckets)."
                )
            dims = self._dims_of(arrays)
            graph_id = 1 + sum(1 for s in self._slots.values() if s.dims == dims)
            slot = self._capture(self._session_for(dims), arrays, dims=dims, graph_id=graph_id)
            self._slots[key] = slot
        return slot

    def _dims_of(self, arrays: dict[str, Any]) -> dict[str, int]:
        return symbolic_dims(self._declared, {k: a.shape for k, a in arrays.items()})

    def _session_for(self, dims: dict[str, int]) -> Any:
        key = tuple(sorted(dims.items()))
        sess = self._sessions.get(key)
        if sess is None:
            # Creation allocates on the device: not while another stream captures.
            with CAPTURE_LOCK.exclusive():
                sess = self._sessions[key] = self.factory(dims)
        return sess

    def _capture(
        self, session: Any, arrays: dict[str, Any], *, dims: dict[str, int], graph_id: int
    ) -> GraphSlot:
        import onnxruntime as ort

        options = ort.RunOptions()
        options.add_run_config_entry(GRAPH_ID_KEY, str(graph_id))
        binding = session.io_binding()
        # Buffers of the slot's own: on ORT's CPU device ortvalue_from_numpy wraps the caller's
        # array without a copy, and the next run's feed would be written into it.
        inputs = {}
        for name, array in arrays.items():
            inputs[name] = ort.OrtValue.ortvalue_from_shape_and_type(
                list(array.shape), array.dtype.type, self.device, self.device_id
            )
            inputs[name].update_inplace(array)
        for name, value in inputs.items():
            binding.bind_ortvalue_input(name, value)
        for name in self._outputs:
            binding.bind_output(name, self.device, self.device_id)
        rows = next((a.shape[0] for a in arrays.values() if a.ndim), 1)
        with CAPTURE_LOCK.exclusive():
            # The outputs' shapes only a run tells: a first run outside any graph (graph id
            # -1: ORT neither counts, captures nor replays it) lets ORT allocate them. The
            # slot's own buffers are bound before the first run of its graph id: bound only
            # after one, the graph kept writing to that run's buffers (onnxruntime-gpu 1.31.1
            # on an H100; every later output stale).
            untracked = ort.RunOptions()
            untracked.add_run_config_entry(GRAPH_ID_KEY, str(NO_GRAPH_ID))
            session.run_with_iobinding(binding, untracked)
            outputs = self._own_outputs(binding.get_outputs())
            binding.clear_binding_outputs()
            for name, value in outputs.items():
                binding.bind_ortvalue_output(name, value)
            for _ in range(CAPTURE_RUNS - 1):  # ORT's warm-up run(s), then its capture
                session.run_with_iobinding(binding, options)
        return GraphSlot(graph_id, dims, inputs, outputs, rows, session, binding, options)

    def _own_outputs(self, first: Sequence[Any]) -> dict[str, Any]:
        """Output buffers of our own, shaped like the first run's: bound from then on.

        The captured graph then writes where callers read. ORT's own outputs of that run are
        not bound again: before onnxruntime 1.30, ``IOBinding.get_outputs()`` returns values
        that point into the binding's output list, which ``clear_binding_outputs()`` frees, and
        binding them again crashed the process (SIGSEGV on 1.20.1, 1.23.2, 1.24.4, 1.25.1,
        1.26.0, 1.28.0 and 1.29.0; not on 1.30.0). Buffers allocated here belong to the slot,
        whatever the version.
        """
        import onnxruntime as ort

        outputs = {}
        for name, value in zip(self._outputs, first, strict=True):
            if not value.is_tensor():
                raise InvalidInputError(
                    f"Output '{name}' is not a tensor: a CUDA-graph session binds every output "
                    "to a device buffer of fixed shape. Turn enable_cuda_graph off."
                )
            outputs[name] = ort.OrtValue.ortvalue_from_shape_and_type(
                list(value.shape()), int(value.element_type()), self.device, self.device_id
            )
        return outputs

    def _replay(self, slot: GraphSlot) -> None:
        with CAPTURE_LOCK.shared():
            slot.session.run_with_iobinding(slot.binding, slot.run_options)


def probe_iobinding() -> None:
    """What a graph session does, on the CPU device: raises (or crashes) where it fails.

    The capability ``iobinding`` (:mod:`sharedml.runtime._capabilities`), run in a child.
    """
    import numpy as np
    import onnxruntime as ort

    model = probe_model()
    x = probe_input()
    plain = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]

    def factory(dims: Mapping[str, int]) -> Any:
        so = ort.SessionOptions()
        for dim, value in dims.items():
            so.add_free_dimension_override_by_name(dim, value)
        return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])

    session = GraphSession(factory({}), factory, device="cpu", device_id=0, max_graphs=2)
    try:
        first = session.run(None, {"x": x})[0]
        second = session.run(None, {"x": x + 1})[0]
        again = session.run(None, {"x": x})[0]
    finally:
        session.close()
    if not (np.array_equal(first, plain) and np.array_equal(again, plain)):
        raise RuntimeError("a bound run computed other outputs than a plain run")
    if np.array_equal(second, plain):
        raise RuntimeError("a bound run did not follow new inputs")

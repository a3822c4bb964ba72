"""What the installed onnxruntime can do, decided once per process by trying it.

sharedml accepts every onnxruntime from the floor in ``pyproject.toml`` on (and
onnxruntime-directml, whose releases stop at 1.24), so no route may assume the newest
behaviour. Each capability below is decided the first time a route asks for it and kept for the
process; a route whose capability is missing is not taken, and the route planner says why in
``pool.mechanism_reason`` (:mod:`sharedml.route._planner`). The host weight mechanisms are measured
the
same way, in :func:`sharedml.weights._store.zero_copy_mechanisms`, and the device routes in child
processes, in :mod:`sharedml.weights._probe`.

``prepacked-save``
    ORT writes its prepacked weights next to the optimized model it saves
    (``session.save_external_prepacked_constant_initializers``) and a session that loads that
    file by path uses them: the saved-model CPU routes (``prepacked-file``, ``optimized-file``).
    Tried in this process on a tiny MatMul model: saved, then reloaded and run (1.20 saves no
    blob; 1.21 on do).
``files-in-memory``
    ``SessionOptions.add_external_initializers_from_files_in_memory`` exists (the Python API
    has it from 1.24): the ``in-memory-file`` mechanism, and the zero-copy read of the weights
    while a saved model is built (without it, ORT reads the weights file by path).
``dlpack``
    ``OrtValue``s are exported to and imported from DLPack, the device weight routes'
    (:mod:`sharedml.weights._dlpack`). The binding has the import as ``OrtValue.from_dlpack`` from
    1.26
    and only on its C class before (1.21 to 1.25); 1.20's CPU build has neither. Tried in this
    process on a CPU value (a round trip that points at the same buffer).
``iobinding``
    A graph session (:class:`sharedml.pool._graphs.GraphSession`) binds device buffers, runs, binds
    output buffers of its own and runs again. A misuse of IOBinding crashed the process before
    1.30 (:meth:`sharedml.pool._graphs.GraphSession._own_outputs`), so this one is tried in a child
    process, on ORT's CPU device: the binding's Python layer, which crashed, is the same for
    every provider. Missing: pools turn ``enable_cuda_graph`` off.

Config keys are covered by what they do, not by their names: ORT accepts any session config
key and ignores those it does not know, so only a probe that watches the effect can tell
(``prepacked-save`` for the saving keys, the zero-copy probe for
``session.use_external_initializer_file_buffers_directly``, ``iobinding`` for the run option
``gpu_graph_id``). ``session.disable_prepacking`` is older than the floor.

``SHAREDML_ORT_WITHOUT`` (:data:`WITHOUT_ENV`), a comma-separated list of these names, declares
them missing without trying them: for a deployment whose build misbehaves in a way no probe
sees, and for tests of the fallback routes on an onnxruntime that has everything.

Thread safety: every function may be called from any thread; concurrent callers of one
capability wait for one probe.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from sharedml.runtime._child import ChildFailed, entry_code, run_child

__all__ = [
    "ort_version",
    "probe_input",
    "probe_model",
    "CAPABILITIES",
    "WITHOUT_ENV",
    "Capability",
    "ChildResult",
    "capabilities",
    "capability",
    "probe_child",
    "probe_failure",
    "run_in_child",
]

WITHOUT_ENV = "SHAREDML_ORT_WITHOUT"
CAPABILITIES: Mapping[str, str] = {
    "prepacked-save": "saving prepacked weights with the optimized model, and loading them",
    "files-in-memory": "SessionOptions.add_external_initializers_from_files_in_memory",
    "dlpack": "DLPack export and import of OrtValues",
    "iobinding": "IOBinding as graph sessions use it (device buffers bound, outputs rebound)",
}
_CHILD_TIMEOUT_S = 120.0  # seconds: a child imports onnxruntime and runs a tiny model
_CHILD_CODE = entry_code("sharedml.runtime._capabilities:probe_child")


@dataclasses.dataclass(frozen=True)
class Capability:
    """Whether the installed onnxruntime can do one thing a route needs.

    Attributes:
        name: One of :data:`CAPABILITIES`.
        available: The probe passed (and the name is not in ``SHAREDML_ORT_WITHOUT``).
        reason: Why not, in one sentence that names the onnxruntime version; "" if available.
        how: How it was decided: ``"tried in this process"``, ``"tried in a child process"``
            or ``"declared missing by SHAREDML_ORT_WITHOUT"``.
    """

    name: str
    available: bool
    reason: str = ""
    how: str = ""


_DECIDED: dict[str, Capability] = {}
_LOCKS = {name: threading.Lock() for name in CAPABILITIES}


def ort_version() -> str:
    import onnxruntime as ort

    return str(ort.__version__)


def _declared_missing() -> set[str]:
    names = {n.strip() for n in os.environ.get(WITHOUT_ENV, "").split(",") if n.strip()}
    unknown = sorted(names - set(CAPABILITIES))
    if unknown:
        raise ValueError(
            f"{WITHOUT_ENV} names {', '.join(map(repr, unknown))}, which sharedml does not know; "
            f"use a comma-separated list of {', '.join(CAPABILITIES)}."
        )
    return names


def capability(name: str) -> Capability:
    """Whether the installed onnxruntime has capability ``name``, tried once per process.

    Args:
        name: One of :data:`CAPABILITIES`.

    Raises:
        ValueError: an unknown name, here or in ``SHAREDML_ORT_WITHOUT``.
    """
    if name not in CAPABILITIES:
        raise ValueError(
            f"Unknown onnxruntime capability {name!r}; use one of {', '.join(CAPABILITIES)}."
        )
    if name in _declared_missing():  # read on every call: the variable may change
        return Capability(
            name,
            False,
            f"{CAPABILITIES[name]} is declared missing by {WITHOUT_ENV}",
            f"declared missing by {WITHOUT_ENV}",
        )
    with _LOCKS[name]:
        decided = _DECIDED.get(name)
        if decided is None:
            how, probe = _PROBES[name]
            try:
                reason = probe()
            except Exception as exc:  # a probe that fails says why; it never fails the caller
                reason = (
                    f"onnxruntime {ort_version()} failed the probe: {type(exc).__name__}: {exc}"
                )
            decided = _DECIDED[name] = Capability(name, not reason, reason, how)
        return decided


def capabilities() -> dict[str, Capability]:
    """Every capability of :data:`CAPABILITIES`, decided (probing those not decided yet)."""
    return {name: capability(name) for name in CAPABILITIES}


# --------------------------------------------------------------------------------------------
# The probes: each returns "" where the capability works, else why not


_PROBE_DIM = 64  # MatMul weight of 64x64 floats (16 KiB): ORT's CPU MatMul prepacks it


def probe_model() -> bytes:
    """``y = x @ W`` on ``x: float32[rows, 64]`` (built from the messages: no onnx import)."""
    import numpy as np

    from sharedml.model import _proto

    pb = _proto.pb2()
    w = np.arange(_PROBE_DIM * _PROBE_DIM, dtype=np.float32).reshape(_PROBE_DIM, _PROBE_DIM) % 7
    tensor = pb.TensorProto(name="w", data_type=pb.TensorProto.FLOAT, dims=[_PROBE_DIM, _PROBE_DIM])
    tensor.raw_data = w.tobytes()
    model = pb.ModelProto(ir_version=8, opset_import=[pb.OperatorSetIdProto(domain="", version=17)])
    graph = model.graph
    graph.name = "sharedml_capability_probe"
    graph.node.add(op_type="MatMul", input=["x", "w"], output=["y"])
    for values, name in ((graph.input, "x"), (graph.output, "y")):
        info = values.add(name=name)
        info.type.tensor_type.elem_type = pb.TensorProto.FLOAT
        info.type.tensor_type.shape.dim.add(dim_param="rows")
        info.type.tensor_type.shape.dim.add(dim_value=_PROBE_DIM)
    graph.initializer.append(tensor)
    return bytes(model.SerializeToString())


def probe_input() -> Any:
    import numpy as np

    return (np.arange(3 * _PROBE_DIM, dtype=np.float32).reshape(3, _PROBE_DIM) % 5) - 2


def _probe_prepacked_save() -> str:
    import numpy as np
    import onnxruntime as ort

    from sharedml.model._graph import ExternalData, iter_tensors, load_graph

    model = probe_model()
    x = probe_input()
    plain = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    # ignore_cleanup_errors: on Windows a file ORT still maps cannot be deleted; the sessions
    # go first below, and a leftover temporary folder must not fail the probe.
    with tempfile.TemporaryDirectory(
        prefix="sharedml-capability-", ignore_cleanup_errors=True
    ) as folder:
        saved = Path(folder) / "model.onnx"
        so = ort.SessionOptions()
        so.log_severity_level = 3
        so.optimized_model_filepath = str(saved)
        for key, value in (
            ("session.optimized_model_external_initializers_file_name", "model.data"),
            ("session.optimized_model_external_initializers_min_size_in_bytes", "0"),
            ("session.save_external_prepacked_constant_initializers", "1"),
        ):
            so.add_session_config_entry(key, value)
        ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
        blobs = [
            key
            for ref in iter_tensors(load_graph(saved).graph)
            if (info := ExternalData.of(ref.tensor)) is not None
            for key, _ in info.entries
            if key.startswith("prepacked_")
        ]
        if not blobs:
            return (
                f"onnxruntime {ort_version()} saves no prepacked weights with its optimized "
                "model (session.save_external_prepacked_constant_initializers is new in "
                "onnxruntime 1.21)"
            )
        again = ort.SessionOptions()
        again.log_severity_level = 3
        again.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        reloaded = ort.InferenceSession(str(saved), again, providers=["CPUExecutionProvider"])
        out = reloaded.run(None, {"x": x})[0]
        del reloaded  # it maps model.data: Windows deletes no mapped file
    if not np.array_equal(out, plain):
        return (
            f"onnxruntime {ort_version()} reloaded its saved prepacked model, but it computed "
            "other outputs than the model it was saved from"
        )
    return ""


def _probe_files_in_memory() -> str:
    import onnxruntime as ort

    if hasattr(ort.SessionOptions(), "add_external_initializers_from_files_in_memory"):
        return ""
    return (
        f"onnxruntime {ort_version()}'s Python API has no "
        "SessionOptions.add_external_initializers_from_files_in_memory (new in 1.24)"
    )


def _probe_iobinding() -> str:
    result = run_in_child("sharedml.pool._graphs:probe_iobinding")
    return "" if result.ok else f"onnxruntime {ort_version()}: {result.reason}"


def _resolve(target: str) -> Callable[[], Any]:
    """The function a ``module:function`` target names."""
    import importlib

    module, _, function = target.partition(":")
    found: Callable[[], Any] = getattr(importlib.import_module(module), function)
    return found


def _beside(target: str) -> Callable[[], str]:
    return lambda: str(_resolve(target)())


_PROBES: Mapping[str, tuple[str, Callable[[], str]]] = {
    "prepacked-save": ("tried in this process", _probe_prepacked_save),
    "files-in-memory": ("tried in this process", _probe_files_in_memory),
    # Probes of a route live beside the code they probe, named here (not imported: the routes
    # build on this module, so it cannot import them).
    "dlpack": ("tried in this process", _beside("sharedml.weights._dlpack:probe_dlpack")),
    "iobinding": ("tried in a child process", _probe_iobinding),
}


# --------------------------------------------------------------------------------------------
# Probes that may crash: run in a child process


@dataclasses.dataclass(frozen=True)
class ChildResult:
    """What a probe in a child process gave.

    Attributes:
        ok: The child ran the probe to the end without an error.
        reason: Why not (the error, or the signal that ended the child); "" when ``ok``.
        seconds: How long it took, the child's start included.
    """

    ok: bool
    reason: str = ""
    seconds: float = 0.0


def probe_child(target: str) -> dict[str, Any]:
    """What a probe child does: run ``target`` and say whether it raised (never raises itself)."""
    try:
        _resolve(target)()
    except BaseException as exc:  # the child reports anything; the parent decides
        return {"ok": False, "reason": f"{type(exc).__name__}: {exc}".strip()[:2000]}
    return {"ok": True, "reason": ""}


def run_in_child(target: str, *, timeout_s: float = _CHILD_TIMEOUT_S) -> ChildResult:
    """Run a probe in a Python child process, so that a crash costs the child only.

    Args:
        target: ``"module:function"``, a function without arguments that raises where the
            probe fails.
        timeout_s: Give up after this many seconds (a failure).

    Returns:
        The result; a child killed by a signal reads ``"the probe crashed (SIGSEGV)..."``.
    """
    start = time.perf_counter()
    try:
        result = run_child(
            [target], code=_CHILD_CODE, what=f"The probe {target}", timeout_s=timeout_s
        )
        ok, reason = bool(result["ok"]), str(result["reason"])
    except ChildFailed as exc:
        ok, reason = False, probe_failure(exc, "it would have crashed the process")
    return ChildResult(ok, reason, time.perf_counter() - start)


def probe_failure(exc: ChildFailed, crashed: str) -> str:
    """Why a probe child gave no result, as a route's reason.

    Args:
        exc: How the child failed.
        crashed: What a crash means, said after it ("this route would crash the process").
    """
    if exc.timed_out:
        return f"the probe did not finish within {exc.timeout_s:.0f} s"
    if exc.crash is not None:
        reason = f"the probe crashed ({exc.crash}): {crashed}"
    elif exc.returncode:
        reason = f"the probe exited with status {exc.returncode} and no result"
    else:  # it could not start, or exited 0 without a readable result
        reason = f"the probe {exc.how}"
    tail = exc.tail[-3:]
    return reason + (f"; stderr: {' | '.join(tail)}" if tail else "")

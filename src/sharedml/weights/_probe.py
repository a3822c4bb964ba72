"""Which device weight route works with the installed onnxruntime: probed in child processes.

A route is worth using only if a session really borrows its buffers, and a route that crashes
must cost a child, never the caller's process (an earlier attempt with
``add_external_initializers`` and DLPack buffers segfaulted). So each route is probed in a
Python child: it uploads two small tensors, builds a session over them, checks the output, then
changes the device buffers and checks that the output follows. The route planner
(:mod:`sharedml.route._planner`) asks :func:`select_route` and hands the answer to
:meth:`sharedml.weights.DeviceWeightStore.for_store`; nothing else starts a probe.

``SHAREDML_DEVICE_ROUTE`` names the route to use without probing (for deployments and
benchmarks that measured it), or ``none`` to use none.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto

from sharedml._errors import ProviderError
from sharedml.runtime._capabilities import capability, probe_failure
from sharedml.runtime._child import ChildFailed, entry_code, run_child
from sharedml.runtime._providers import CPU, CUDA, DML, DML_NO_DEVICE_ROUTE
from sharedml.weights._device import DEVICE_TYPES, ROUTES, DeviceWeightStore
from sharedml.weights._dlpack import RouteError
from sharedml.weights._store import TensorSlot

__all__ = [
    "ROUTE_ENV",
    "RouteProbe",
    "device_mechanism_available",
    "probe_child",
    "probe_routes",
    "select_route",
]

ROUTE_ENV = "SHAREDML_DEVICE_ROUTE"
_PROBE_TIMEOUT_S = 300.0  # seconds: a first CUDA initialization can take a minute
# What a probe child runs: ``provider device_id route`` follow in sys.argv.
_PROBE_CODE = entry_code("sharedml.weights._probe:probe_child")

# --------------------------------------------------------------------------------------------
# Which route works here: probed in child processes, so a crash costs only the child


@dataclasses.dataclass(frozen=True)
class RouteProbe:
    """What probing one route gave.

    Attributes:
        route: One of :data:`ROUTES`.
        provider: The execution provider probed.
        device_id: The device probed.
        ok: A probe session used the route's device buffers in place.
        reason: Why not (empty when ``ok``), e.g. the error or the signal that killed the probe.
        seconds: How long the probe took, the child's start included.
    """

    route: str
    provider: str
    device_id: int
    ok: bool
    reason: str = ""
    seconds: float = 0.0


_PROBE_ELEMENTS = 1024
_PROBE_STRIDE_BYTES = 4096  # the probe's second tensor sits at a non-zero, aligned offset


@dataclasses.dataclass
class _ProbeWeights:
    buffer: np.ndarray
    slots: tuple[TensorSlot, ...]


def _probe_weights(w0: float, w1: float) -> _ProbeWeights:
    buffer = np.zeros(2 * _PROBE_STRIDE_BYTES, np.uint8)
    buffer[: 4 * _PROBE_ELEMENTS].view(np.float32)[:] = w0
    buffer[_PROBE_STRIDE_BYTES : _PROBE_STRIDE_BYTES + 4 * _PROBE_ELEMENTS].view(np.float32)[:] = w1
    slots = tuple(
        TensorSlot(name, TensorProto.FLOAT, (_PROBE_ELEMENTS,), i * _PROBE_STRIDE_BYTES, 4096)
        for i, name in enumerate(("w0", "w1"))
    )
    return _ProbeWeights(buffer, slots)


def _probe_model() -> bytes:
    from onnx import helper

    zeros = np.zeros(_PROBE_ELEMENTS, np.float32)
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "w0"], ["t"]), helper.make_node("Add", ["t", "w1"], ["y"])],
        "sharedml_device_probe",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [_PROBE_ELEMENTS])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [_PROBE_ELEMENTS])],
        # Zeros in the graph: a session that ignored the registered buffers outputs zeros.
        initializer=[onnx.numpy_helper.from_array(zeros, n) for n in ("w0", "w1")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return bytes(model.SerializeToString())


def _probe_here(provider: str, device_id: int, route: str) -> None:
    """Raise unless ``route`` lends buffers that a ``provider`` session uses in place."""
    import onnxruntime as ort

    if provider == CUDA and hasattr(ort, "preload_dlls"):
        ort.preload_dlls()  # as a CUDA user's process does; harmless where torch loaded them
    if provider not in ort.get_available_providers():
        raise RouteError(f"{provider} is not available in this onnxruntime build")
    store = DeviceWeightStore(_probe_weights(1.0, 2.0), provider, device_id, route=route)
    if set(store.tensor_names) != {"w0", "w1"}:
        raise RouteError("the route left probe tensors on the host")
    so = ort.SessionOptions()
    so.log_severity_level = 3
    store.register(so)
    providers: list[Any] = [(provider, {"device_id": str(device_id)}) if provider != CPU else CPU]
    if provider != CPU:
        providers.append(CPU)
    sess = ort.InferenceSession(_probe_model(), so, providers=providers)
    x = np.ones(_PROBE_ELEMENTS, np.float32)
    first = float(sess.run(None, {"x": x})[0][-1])
    if first != 3.0:
        raise RouteError(f"the probe session computed {first}, not 3.0: it ignored the buffers")
    store.reload(_probe_weights(3.0, 4.0).buffer)
    second = float(sess.run(None, {"x": x})[0][-1])
    if second != 7.0:
        raise RouteError(
            f"the probe session computed {second} after the device buffers changed, not 7.0: "
            "ORT copied the weights instead of borrowing them"
        )


def probe_child(provider: str, device_id: str, route: str) -> dict[str, Any]:
    """What a probe child does: probe one route and say how it went (never raises itself)."""
    try:
        _probe_here(provider, int(device_id), route)
    except BaseException as exc:  # the child reports anything; the parent decides
        return {"ok": False, "reason": f"{type(exc).__name__}: {exc}".strip()[:2000]}
    return {"ok": True, "reason": ""}


def _run_probe(provider: str, device_id: int, route: str, timeout_s: float) -> RouteProbe:
    """Probe one route in a child process."""
    start = time.perf_counter()
    try:
        result = run_child(
            [provider, str(device_id), route],
            code=_PROBE_CODE,
            what=f"The {route} probe of {provider}",
            timeout_s=timeout_s,
        )
        ok, reason = bool(result["ok"]), str(result["reason"])
    except ChildFailed as exc:
        ok, reason = False, probe_failure(exc, "this route would crash the process")
    return RouteProbe(route, provider, device_id, ok, reason, time.perf_counter() - start)


_PROBES: dict[tuple[str, int], tuple[RouteProbe, ...]] = {}
_PROBES_LOCK = threading.Lock()


def _provider_available(provider: str) -> bool:
    import onnxruntime as ort

    return provider in ort.get_available_providers()


def probe_routes(
    provider: str,
    device_id: int = 0,
    *,
    routes: Sequence[str] = ROUTES,
    stop_at_first: bool = True,
    refresh: bool = False,
    timeout_s: float = _PROBE_TIMEOUT_S,
) -> tuple[RouteProbe, ...]:
    """Probe device weight routes for ``provider`` on ``device_id``, each in a child process.

    The default call (every route, stopping at the first that works) is cached for the process.

    Args:
        provider: An execution provider name.
        device_id: The device to probe.
        routes: Which routes, in order of preference.
        stop_at_first: Stop after the first route that works.
        refresh: Probe again even if cached.
        timeout_s: Give up on a probe after this many seconds (counted as a failure).

    Returns:
        One result per route probed, in order; empty if the provider is not available or has
        no device store.

    Thread safety: may be called from any thread; concurrent callers wait for one probe.
    """
    cacheable = tuple(routes) == ROUTES and stop_at_first
    key = (provider, device_id)
    with _PROBES_LOCK:
        if cacheable and not refresh and key in _PROBES:
            return _PROBES[key]
        if provider not in DEVICE_TYPES or not _provider_available(provider):
            results: tuple[RouteProbe, ...] = ()
        elif provider == DML:  # no route can work there: not worth a child process each
            results = tuple(
                RouteProbe(route, provider, device_id, False, DML_NO_DEVICE_ROUTE)
                for route in routes
            )
        elif not (dlpack := capability("dlpack")).available:
            # Every route lends DLPack imports: no child can succeed, so none is started.
            results = tuple(
                RouteProbe(r, provider, device_id, ok=False, reason=dlpack.reason) for r in routes
            )
        else:
            found: list[RouteProbe] = []
            for route in routes:
                found.append(_run_probe(provider, device_id, route, timeout_s))
                if stop_at_first and found[-1].ok:
                    break
            results = tuple(found)
        if cacheable:
            _PROBES[key] = results
        return results


def select_route(provider: str, device_id: int = 0) -> str | None:
    """The device weight route to use for ``provider`` on ``device_id``, or ``None``.

    ``SHAREDML_DEVICE_ROUTE`` (:data:`ROUTE_ENV`) set to a route uses it without probing, set
    to ``none`` uses none; otherwise the first route that :func:`probe_routes` finds working.

    Raises:
        ProviderError: ``SHAREDML_DEVICE_ROUTE`` names no route.
    """
    forced = os.environ.get(ROUTE_ENV, "").strip()
    if forced:
        if forced.lower() == "none":
            return None
        if forced not in ROUTES:
            raise ProviderError(
                f"{ROUTE_ENV}={forced!r} is not a device weight route; use one of {ROUTES} "
                "or 'none'."
            )
        return forced
    for probe in probe_routes(provider, device_id):
        if probe.ok:
            return probe.route
    return None


def device_mechanism_available(provider: str, device_id: int = 0) -> bool:
    """Whether sessions of ``provider`` can borrow weights from a :class:`DeviceWeightStore`.

    Probed once per process and provider (each route in a child process), so it never
    crashes the caller. ``False`` for providers without a device store (CPU included: its
    sessions share host memory directly).
    """
    if provider not in DEVICE_TYPES or provider == CPU:
        return False
    try:
        return select_route(provider, device_id) is not None
    except Exception:
        return False

"""Execution-provider policy: what each provider needs so that N sessions can share weights.

:data:`PROVIDER_FACTS` is the one table of what sharedml knows of each provider: whether Runs of
several sessions may overlap, whether sessions can borrow one device copy of the weights, how
they get the weights otherwise, and how many sessions a pool holds by default; each row says
why and where it was verified (README, "Execution providers"). A provider the table does not
know runs one ``Run`` at a time per device until the caller says its runs may overlap
(``SessionPool(serialize_runs=False)``): a crash is worse than a queue.

- DirectML (Windows): ORT documents that a DML session must not run ``Run`` from two threads at
  once, needs memory patterns off and sequential execution (ORT forces both, with a warning),
  and takes a ``device_id`` (without one, onnxruntime-directml asks dxcore for an adapter, and
  where that fails it falls back to the CPU with only a printed error). Two threads in ``Run``
  on one DML session crash the process (reproduced on onnxruntime-directml 1.24.4:
  ``tests/test_dml.py``). Several DML sessions running on several threads at once hang or
  crash on onnxruntime-directml 1.18+ (ORT issue #20713; all sessions a Python process creates
  share one DML queue per device), so :func:`serialize_runs_by_default` says to run one ``Run``
  at a time across the process there, and the pool defaults to one session with batching.
  DML sessions cannot share device weights (:data:`DML_NO_DEVICE_ROUTE`): each holds its own
  device copy, which is one more reason for one session. Graph fusion stays on (ORT's
  default): it cost no memory where measured (``docs/directml.md``).
- WebGPU (a plugin EP: :mod:`sharedml.runtime._plugins`): every session of a process shares one
  WebGPU context, and two sessions in ``Run`` at once crash the process (ORT issue #32561;
  ``tests/test_webgpu.py``), across models: runs are serialized per device for the whole
  process, one session with batching by default, weights loaded by ORT from the mapped file.
- CUDA: a ``device_id`` (default 0) and ``use_ep_level_unified_stream=1`` (one stream per
  session: the pool never runs a session from two threads at once, and per-run streams each
  bring their own cuBLAS/cuDNN handles and workspaces, which cost device memory and bought no
  throughput where measured: ``docs/gpu.md``); weights are shared through the device weight
  store.
- CPU: always appended last as the fallback for nodes other providers do not take.
- Plugin EPs are chosen by device (``add_provider_for_devices``), never by ``providers=``
  (:meth:`ProviderPlan.session_kwargs`), and every session is checked to run on the provider
  asked for (:meth:`ProviderPlan.check_session`): ORT falls back to the CPU printing to stdout.

What was verified where (DirectML ran in software under Wine, WebGPU on Mesa's lavapipe, not
on GPUs): README and ``docs/directml.md``, ``docs/webgpu.md``.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping, Sequence
from typing import Any

from sharedml._errors import ProviderError
from sharedml._host._onnxruntime import check_one_onnxruntime
from sharedml.runtime._capabilities import capability
from sharedml.runtime._plugins import (
    WEBGPU,
    DeviceSelector,
    PluginDevice,
    is_plugin,
    resolve_plugin,
)

__all__ = [
    "GRAPH_DEVICES",
    "cuda_graphs_enabled",
    "graphs_requested",
    "graphs_unavailable",
    "CPU",
    "CUDA",
    "CUDA_SESSION_DEFAULTS",
    "DML",
    "DML_NO_DEVICE_ROUTE",
    "OPENVINO",
    "PROVIDER_FACTS",
    "TENSORRT_RTX",
    "WEBGPU",
    "ProviderFacts",
    "ProviderPlan",
    "ProviderSettings",
    "ProviderSpec",
    "RunsRule",
    "WeightsRoute",
    "available_providers",
    "facts_for",
    "plan_from_spec",
    "plan_providers",
    "runs_rule",
    "serialize_runs_by_default",
]

CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"
DML = "DmlExecutionProvider"
OPENVINO = "OpenVINOExecutionProvider"
TENSORRT_RTX = "nv_tensorrt_rtx"  # the TensorRT-RTX plugin's EP name (its get_ep_name())

ProviderSpec = str | tuple[str, dict[str, Any]]

# Why DirectML sessions never borrow device weights: ORT's DLPack bridge exports CPU and CUDA
# tensors only (onnxruntime-directml has no OrtValue.from_dlpack at all), and an initializer
# given in host memory is copied to the device ("Cannot use user supplied initializer ...
# planned memory location ... is different"). Seen on onnxruntime-directml 1.24.4.
DML_NO_DEVICE_ROUTE = (
    "DirectML sessions cannot share device weights: ORT uploads a device copy of the weights "
    "per session (its DLPack bridge exports CPU and CUDA tensors only, so no device route is "
    "tried)"
)

# CUDA provider options the pool sets unless the caller set them (see the module docstring).
CUDA_SESSION_DEFAULTS: dict[str, str] = {"use_ep_level_unified_stream": "1"}


class WeightsRoute(str, enum.Enum):
    """How a provider's sessions get the weights (a column of :data:`PROVIDER_FACTS`)."""

    HOST = "host"
    """Borrowed zero-copy from the host map (the route planner measures which mechanism)."""
    DEVICE = "device"
    """Uploaded once per device and borrowed there, where a route works; else as ``HOST``."""
    ORT_MMAP = "ort-mmap"
    """ORT loads them from the prepared, mapped file; each session keeps its own device copy."""


@dataclasses.dataclass(frozen=True)
class ProviderFacts:
    """What sharedml knows of one execution provider: one row of :data:`PROVIDER_FACTS`.

    Attributes:
        provider: Its name.
        runs_overlap: Whether ``Run`` calls of several sessions on one device may overlap (each
            session still runs one ``Run`` at a time: the pool guarantees that). False: the
            pool serializes them per device across the process, every pool and model alike.
        serialized_from: Where ``runs_overlap`` is False from an onnxruntime version on only
            (DirectML: 1.18); None: for every version.
        device_route: Sessions can borrow one device copy of the weights (the device store).
        weights: How sessions get the weights.
        default_sessions: Sessions in a pool by default (1: with batching where it is proven).
        no_device_route: Why no device route is tried, for the route's reason ("" where one is).
        rule: Why the runs may or may not overlap, with its source.
        verified: Where, and with what, sharedml ran this row.
    """

    provider: str
    runs_overlap: bool
    device_route: bool
    weights: WeightsRoute
    default_sessions: int
    rule: str
    verified: str
    serialized_from: tuple[int, ...] | None = None
    no_device_route: str = ""

    def serialized(self, ort_version: str) -> bool:
        """Whether runs are serialized on onnxruntime ``ort_version``."""
        if self.runs_overlap:
            return False
        return self.serialized_from is None or _version_tuple(ort_version) >= self.serialized_from


_WEBGPU_NO_DEVICE_ROUTE = (
    "WebGPU sessions cannot share device weights: no Python API lends a device buffer to a "
    "WebGPU session, so ORT uploads a device copy of the weights per session"
)
_PLUGIN_NO_DEVICE_ROUTE = (
    "{provider} sessions cannot share device weights: sharedml has no route that lends a device "
    "buffer to a plugin execution provider's session, so each session holds its own copy"
)

PROVIDER_FACTS: Mapping[str, ProviderFacts] = {
    CPU: ProviderFacts(
        CPU,
        runs_overlap=True,
        device_route=False,
        weights=WeightsRoute.HOST,
        default_sessions=4,
        rule="CPU sessions run side by side (Run releases the GIL)",
        verified="Linux x86-64, onnxruntime 1.20, 1.24.4 and 1.32.0 (CI)",
    ),
    CUDA: ProviderFacts(
        CUDA,
        runs_overlap=True,
        device_route=True,
        weights=WeightsRoute.DEVICE,
        default_sessions=4,
        rule="CUDA sessions run side by side, each on its own stream",
        verified="H100 and H200, onnxruntime-gpu 1.31.1 (docs/gpu.md)",
    ),
    DML: ProviderFacts(
        DML,
        runs_overlap=False,
        serialized_from=(1, 18),
        device_route=False,
        weights=WeightsRoute.ORT_MMAP,
        default_sessions=1,
        rule=(
            "several DirectML sessions running at once hang or crash on onnxruntime-directml "
            "1.18 and later (ORT issue #20713): one Run at a time per device, process-wide"
        ),
        verified="onnxruntime-directml 1.24.4 under Wine on Mesa's lavapipe (docs/directml.md)",
        no_device_route=DML_NO_DEVICE_ROUTE,
    ),
    WEBGPU: ProviderFacts(
        WEBGPU,
        runs_overlap=False,
        device_route=False,
        weights=WeightsRoute.ORT_MMAP,
        default_sessions=1,
        rule=(
            "two WebGPU sessions in Run at once crash the process, of one model or two (ORT "
            "issue #32561, reproduced: docs/webgpu.md): one Run at a time per device, "
            "process-wide"
        ),
        verified=(
            "onnxruntime 1.32.0 and onnxruntime-ep-webgpu 0.4.0 on Mesa's lavapipe (docs/webgpu.md)"
        ),
        no_device_route=_WEBGPU_NO_DEVICE_ROUTE,
    ),
    OPENVINO: ProviderFacts(
        OPENVINO,
        runs_overlap=True,
        device_route=False,
        weights=WeightsRoute.ORT_MMAP,
        default_sessions=1,
        rule=(
            "OpenVINO sessions ran side by side (4 sessions, and one session from 8 threads, on "
            "its CPU device); each session compiles its own copy of the weights, so one session "
            "with batching is the default"
        ),
        verified=(
            "onnxruntime 1.32.0 and onnxruntime-ep-openvino 1.8.1 on an Intel Xeon's CPU device "
            "(docs/webgpu.md, other plugin EPs)"
        ),
        no_device_route=_PLUGIN_NO_DEVICE_ROUTE.format(provider=OPENVINO),
    ),
    TENSORRT_RTX: ProviderFacts(
        TENSORRT_RTX,
        runs_overlap=False,
        device_route=False,
        weights=WeightsRoute.ORT_MMAP,
        default_sessions=1,
        rule=(
            "not yet run on a GPU by sharedml: one Run at a time per device until measured "
            "(benchmarks/plugin_ep_gpu.py); pass serialize_runs=False to let runs overlap"
        ),
        verified="not run (no NVIDIA GPU here): benchmarks/plugin_ep_gpu.py is the check",
        no_device_route=_PLUGIN_NO_DEVICE_ROUTE.format(provider=TENSORRT_RTX),
    ),
}


def facts_for(provider: str, *, plugin: bool = False) -> ProviderFacts:
    """The row of :data:`PROVIDER_FACTS` for ``provider``; a cautious one for a provider it lacks.

    Args:
        provider: The provider's name.
        plugin: It runs as a plugin EP (its weights then go through ORT's own load).
    """
    found = PROVIDER_FACTS.get(provider)
    if found is not None:
        return found
    return ProviderFacts(
        provider,
        runs_overlap=False,
        device_route=False,
        weights=WeightsRoute.ORT_MMAP if plugin else WeightsRoute.HOST,
        default_sessions=1,
        rule=(
            f"{provider} is not in sharedml's provider table: one Run at a time per device, "
            "process-wide, until you say its runs may overlap (SessionPool(serialize_runs=False))"
        ),
        verified="not run by sharedml",
        no_device_route=_PLUGIN_NO_DEVICE_ROUTE.format(provider=provider) if plugin else "",
    )


def available_providers() -> list[str]:
    """The execution providers of the installed onnxruntime build."""
    import onnxruntime as ort

    return list(ort.get_available_providers())


@dataclasses.dataclass(frozen=True)
class ProviderPlan:
    """The providers a pool passes to every session, and the session settings they need.

    Attributes:
        providers: Provider names, in priority order, CPU last.
        provider_options: One options dict per provider.
        config_entries: ``SessionOptions`` config entries the providers need (set only where
            the caller did not set them).
        disable_mem_pattern: Memory patterns must be off (DirectML).
        sequential_execution: Execution mode must be sequential (DirectML).
        plugin: Where the primary provider is a plugin EP, its library and device (plain data:
            :meth:`to_spec` carries it to child processes); None for a built-in provider.
    """

    providers: tuple[str, ...]
    provider_options: tuple[dict[str, str], ...]
    config_entries: tuple[tuple[str, str], ...] = ()
    disable_mem_pattern: bool = False
    sequential_execution: bool = False
    plugin: PluginDevice | None = None

    @property
    def primary(self) -> str:
        """The provider that runs most of the graph."""
        return self.providers[0]

    @property
    def device_id(self) -> int:
        """The device of the primary provider (0 for CPU and plugin EPs)."""
        return int(self.provider_options[0].get("device_id", 0))

    @property
    def device_key(self) -> str:
        """Names the primary provider's device: the key of its process-wide run lock."""
        if self.plugin is not None:
            return self.plugin.key
        return f"{self.primary}:{self.device_id}"

    @property
    def device(self) -> str:
        """The device the sessions run on, in words (a plugin EP's: its hardware)."""
        if self.plugin is not None:
            return f"{self.primary} on {self.plugin.description}"
        if self.primary == CPU:
            return "CPU"
        return f"{self.primary} device {self.device_id}"

    @property
    def facts(self) -> ProviderFacts:
        """The primary provider's row of :data:`PROVIDER_FACTS`."""
        return facts_for(self.primary, plugin=self.plugin is not None)

    def to_spec(self) -> dict[str, Any]:
        """Plain, JSON-ready arguments of :func:`plan_providers` that plan the same providers.

        A child process (inspect's measuring children, a worker, a Ray replica) given them
        registers the same plugin library and picks the same device.
        """
        spec: dict[str, Any] = {
            "providers": list(self.providers),
            "provider_options": [dict(o) for o in self.provider_options],
        }
        if self.plugin is not None:
            if self.plugin.library is not None:
                spec["ep_libraries"] = {self.primary: self.plugin.library}
            spec["ep_devices"] = {self.primary: self.plugin.selector.to_dict()}
        return spec

    def session_kwargs(self, sess_options: Any) -> dict[str, Any]:
        """``InferenceSession``'s provider arguments; a plugin's device goes into the options.

        A plugin EP is chosen by device (``add_provider_for_devices``) and never by
        ``providers=``, which would make ORT ignore the device. ORT's fallback to the CPU is off
        for every provider but the CPU (``enable_fallback=0``; older onnxruntime versions ignore
        the keyword, and :meth:`check_session` catches their fallback).

        Args:
            sess_options: The session's own ``SessionOptions`` (modified for a plugin EP).

        Raises:
            ProviderError: the plugin's device is no longer listed in this process.
        """
        kwargs: dict[str, Any] = {}
        if self.plugin is not None:
            sess_options.add_provider_for_devices(
                self.plugin.devices(), dict(self.provider_options[0])
            )
        else:
            kwargs["providers"] = list(self.providers)
            kwargs["provider_options"] = [dict(o) for o in self.provider_options]
        if self.primary != CPU:
            kwargs["enable_fallback"] = 0
        return kwargs

    def check_session(self, sess: Any, what: str) -> None:
        """Raise unless ``sess`` runs on the primary provider; turn ORT's run-time fallback off.

        ORT falls back to the CPU where a provider fails to start, saying so on stdout only, and
        a session that fails a run with ``EPFail`` re-creates itself on the CPU; a pool of N
        sessions that silently runs on the CPU is a surprise worth an error.

        Args:
            sess: A new ``InferenceSession``.
            what: The session, for the message ("A session of 'model.onnx'").

        Raises:
            ProviderError: the session runs on another provider.
        """
        if self.primary == CPU:
            return
        got = list(sess.get_providers())
        if not got or got[0] != self.primary:
            raise ProviderError(
                f"{what} runs on {got[0] if got else 'no provider'} instead of {self.primary} "
                f"({self.device}): onnxruntime could not start {self.primary} for it and fell "
                "back (its message went to stdout). Check the provider's installation and "
                "options; its own error is printed above this one."
            )
        disable = getattr(sess, "disable_fallback", None)
        if callable(disable):
            disable()


def _is_ep_device(value: Any) -> bool:
    """An ``onnxruntime.OrtEpDevice`` (told by its shape: tests fake it)."""
    return hasattr(value, "ep_name") and hasattr(value, "device") and not isinstance(value, str)


def _normalize(
    providers: Sequence[ProviderSpec] | None,
    provider_options: Sequence[dict[str, Any]] | None,
) -> tuple[list[tuple[str, dict[str, str]]], dict[str, Any]]:
    """``(name, options)`` per provider, and the ``OrtEpDevice`` objects given in their place."""
    if providers is None:
        return [(CPU, {})], {}
    entries: list[Any] = (
        [providers] if isinstance(providers, str) or _is_ep_device(providers) else list(providers)
    )
    if provider_options is not None and len(provider_options) != len(entries):
        raise ProviderError(
            f"provider_options has {len(provider_options)} entries for {len(entries)} providers; "
            "give one dict per provider."
        )
    out: list[tuple[str, dict[str, str]]] = []
    devices: dict[str, Any] = {}
    for i, spec in enumerate(entries):
        name: Any
        if isinstance(spec, tuple):
            name, opts = spec
        else:
            name, opts = spec, {}
        if _is_ep_device(name) or (
            isinstance(name, (list, tuple)) and name and all(_is_ep_device(d) for d in name)
        ):
            chosen = list(name) if isinstance(name, (list, tuple)) else [name]
            name = chosen[0].ep_name
            devices[name] = chosen
        if not isinstance(name, str):
            raise ProviderError(
                f"providers[{i}] must be a provider's name, (name, options), or an "
                f"onnxruntime.OrtEpDevice, not {spec!r}."
            )
        if provider_options is not None:
            opts = {**opts, **provider_options[i]}
        out.append((name, {str(k): str(v) for k, v in opts.items()}))
    return out, devices


def _device_choice(name: str, value: Any) -> DeviceSelector | list[Any]:
    """An ``ep_devices`` entry: a selector (or its dict form), or ``OrtEpDevice`` objects."""
    if isinstance(value, DeviceSelector):
        return value
    if isinstance(value, Mapping):
        return DeviceSelector.from_dict(value)
    if isinstance(value, str):
        return DeviceSelector.parse(value)
    chosen = list(value) if isinstance(value, (list, tuple)) else [value]
    if chosen and all(_is_ep_device(d) for d in chosen):
        return chosen
    raise ProviderError(
        f"ep_devices['{name}'] must be a sharedml.runtime.DeviceSelector or OrtEpDevice objects "
        f"from onnxruntime.get_ep_devices(), not {value!r}."
    )


@dataclasses.dataclass(frozen=True)
class ProviderSettings:
    """Which execution providers a pool's sessions run on, as the caller spelled them.

    ``SessionPool``'s provider arguments travel together: :meth:`plan` resolves them once
    into the :class:`ProviderPlan` every session is created with; ``serialize_runs`` then says
    which rule on runs applies (:func:`runs_rule`).

    Attributes:
        providers: As for ``onnxruntime.InferenceSession`` (see :func:`plan_providers`);
            None means CPU.
        provider_options: As for ``InferenceSession``: one dict per provider.
        ep_libraries: A plugin EP's library path per EP name.
        ep_devices: A plugin EP's device per EP name.
        serialize_runs: One ``Run`` at a time on the device across the process: True, False,
            or None for the provider table's rule.
    """

    providers: Sequence[ProviderSpec] | None = None
    provider_options: Sequence[dict[str, Any]] | None = None
    ep_libraries: Mapping[str, Any] | None = None
    ep_devices: Mapping[str, Any] | None = None
    serialize_runs: bool | None = None

    def plan(self, *, available: Sequence[str] | None = None) -> ProviderPlan:
        """The plan: :func:`plan_providers` of these settings (registers plugin EPs once).

        Raises:
            ProviderError: as :func:`plan_providers`.
        """
        return plan_providers(
            self.providers,
            self.provider_options,
            available=available,
            ep_libraries=self.ep_libraries,
            ep_devices=self.ep_devices,
        )


def plan_providers(
    providers: Sequence[ProviderSpec] | None = None,
    provider_options: Sequence[dict[str, Any]] | None = None,
    *,
    available: Sequence[str] | None = None,
    ep_libraries: Mapping[str, Any] | None = None,
    ep_devices: Mapping[str, Any] | None = None,
) -> ProviderPlan:
    """Apply the provider policy to what the caller asked for.

    A name that is not a provider of this onnxruntime build is taken for a plugin EP: its
    library is found (``ep_libraries``, one registered already, or its package), registered
    once per process, and its device chosen (:func:`sharedml.runtime._plugins.resolve_plugin`).

    Args:
        providers: As for ``onnxruntime.InferenceSession``: names or ``(name, options)`` pairs;
            also an ``OrtEpDevice`` (or ``(OrtEpDevice, options)``) of a plugin EP, as Windows
            ML hands them out. ``None`` means CPU.
        provider_options: As for ``InferenceSession``: one dict per provider.
        available: The providers of the installed build (default: asked from onnxruntime).
        ep_libraries: A plugin EP's library path per EP name.
        ep_devices: A plugin EP's device per EP name: a
            :class:`~sharedml.runtime.DeviceSelector` (or its dict or text form), or
            ``OrtEpDevice`` objects. Default: the first device the EP lists.

    Returns:
        The plan every session of a pool is created with.

    Raises:
        ProviderError: a provider that this onnxruntime build does not have and no plugin
            library provides, a plugin EP without a device here, or a combination of providers
            that cannot run together. ORT itself would warn and silently fall back to CPU; a
            pool of N sessions that silently runs on the CPU is a surprise worth an error.
    """
    requested, given_devices = _normalize(providers, provider_options)
    libraries = {str(k): v for k, v in (ep_libraries or {}).items()}
    choices: dict[str, Any] = {str(k): _device_choice(k, v) for k, v in (ep_devices or {}).items()}
    for name, devices in given_devices.items():
        if name in choices:
            raise ProviderError(
                f"{name}'s device is given twice (an OrtEpDevice in providers and ep_devices); "
                "give it once."
            )
        choices[name] = devices
    if available is None:
        check_one_onnxruntime()  # the first place sharedml needs onnxruntime itself
    available = list(available) if available is not None else available_providers()
    names = [name for name, _ in requested]
    plugins = [
        name
        for name in names
        if name in libraries
        or name in choices
        or (name not in available and name not in (CUDA, DML))
        or (name not in (CPU, CUDA, DML) and is_plugin(name))
    ]
    missing = [name for name in names if name not in available and name not in plugins]
    if missing:
        hint = ""
        if CUDA in missing:
            hint = (
                " Install onnxruntime-gpu in place of onnxruntime: pip uninstall -y onnxruntime "
                "&& pip install onnxruntime-gpu (README, Install)."
            )
        elif DML in missing:
            hint = " DirectML needs Windows and the 'onnxruntime-directml' package."
        raise ProviderError(
            f"Execution provider(s) {', '.join(missing)} are not available in this onnxruntime "
            f"build (available: {', '.join(available)}).{hint}"
        )
    unused = sorted((set(libraries) | set(choices)) - set(plugins))
    if unused:
        raise ProviderError(
            f"ep_libraries or ep_devices name {', '.join(unused)}, which providers does not "
            "ask for; name the provider in providers too."
        )
    plugin: PluginDevice | None = None
    if plugins:
        others = [n for n in names if n not in (plugins[0], CPU)]
        if names[0] != plugins[0] or others:
            raise ProviderError(
                f"A plugin execution provider ({plugins[0]}) runs first and alone (the CPU "
                f"aside): a session chooses it by device, and no other provider's options reach "
                f"that session. Ask for [{plugins[0]!r}] (CPU runs what it does not take), not "
                f"{names}."
            )
        plugin = resolve_plugin(
            plugins[0],
            library=libraries.get(plugins[0]),
            choice=choices.get(plugins[0]),
            available=available,
        )
    config: list[tuple[str, str]] = []
    disable_mem_pattern = sequential = False
    planned: list[tuple[str, dict[str, str]]] = []
    for name, opts in requested:
        if name in (CUDA, DML):
            opts = {"device_id": "0", **opts}
        if name == CUDA:
            opts = {**CUDA_SESSION_DEFAULTS, **opts}
        if name == DML:
            disable_mem_pattern = sequential = True
        planned.append((name, opts))
    if CPU not in names:
        planned.append((CPU, {}))
    return ProviderPlan(
        providers=tuple(name for name, _ in planned),
        provider_options=tuple(opts for _, opts in planned),
        config_entries=tuple(config),
        disable_mem_pattern=disable_mem_pattern,
        sequential_execution=sequential,
        plugin=plugin,
    )


def plan_from_spec(spec: Mapping[str, Any]) -> ProviderPlan:
    """The plan :meth:`ProviderPlan.to_spec` describes, made in this process.

    Registers the same plugin library and picks the same device; ``spec`` may hold other keys
    (a measuring child's spec), which are ignored.
    """
    return plan_providers(
        list(spec["providers"]),
        [dict(o) for o in spec["provider_options"]],
        ep_libraries=spec.get("ep_libraries"),
        ep_devices=spec.get("ep_devices"),
    )


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


@dataclasses.dataclass(frozen=True)
class RunsRule:
    """Whether a pool's runs are serialized per device across the process, and which rule said so.

    Attributes:
        serialized: One ``Run`` at a time on the device, across every pool of the process.
        reason: The rule that applied, in one sentence (``pool.stats().runs_rule``).
    """

    serialized: bool
    reason: str


def runs_rule(
    plan: ProviderPlan, ort_version: str | None = None, *, asked: bool | None = None
) -> RunsRule:
    """Whether runs are serialized for this plan, and why: the caller's word, else the table.

    Args:
        plan: The providers.
        ort_version: The installed onnxruntime's version (default: asked from onnxruntime).
        asked: ``serialize_runs`` as the caller gave it (None: the table decides).
    """
    facts = plan.facts
    if asked is not None:
        said = "serialized" if asked else "allowed to overlap"
        return RunsRule(
            asked,
            f"runs {said} by the caller (serialize_runs={asked}); sharedml's table says: "
            f"{facts.rule}",
        )
    if ort_version is None:
        import onnxruntime as ort

        ort_version = str(ort.__version__)
    serialized = facts.serialized(ort_version)
    if facts.serialized_from is not None and not serialized:
        return RunsRule(
            False,
            f"runs overlap: {plan.primary} serializes runs from onnxruntime "
            f"{'.'.join(map(str, facts.serialized_from))} on, and this is {ort_version}",
        )
    return RunsRule(serialized, facts.rule)


def serialize_runs_by_default(plan: ProviderPlan, ort_version: str | None = None) -> bool:
    """Whether runs must be serialized across the whole pool for this provider and version.

    As :data:`PROVIDER_FACTS` says (:func:`runs_rule`): DirectML on onnxruntime 1.18 and later,
    WebGPU always, and every provider the table does not know.
    """
    return runs_rule(plan, ort_version).serialized


# The providers whose graphs a pool drives, and the device name of their buffers. (Tests add
# the CPU provider: the machinery then runs, capture aside, on machines without a GPU.)
GRAPH_DEVICES: dict[str, str] = {"CUDAExecutionProvider": "cuda"}


def graphs_requested(provider: str, provider_options: Mapping[str, str]) -> bool:
    flag = str(provider_options.get("enable_cuda_graph", "0")).lower() in ("1", "true")
    return flag and provider in GRAPH_DEVICES


def graphs_unavailable(provider: str, provider_options: Mapping[str, str]) -> str:
    """Why the CUDA graphs that ``provider_options`` ask for cannot run here; "" where they can.

    They need IOBinding to work as the pool's graph sessions use it, which is tried once per
    process in a child (capability ``iobinding``, :mod:`sharedml.runtime._capabilities`); ""
    also where the options ask for no graphs.
    """
    if not graphs_requested(provider, provider_options):
        return ""
    iobinding = capability("iobinding")
    return "" if iobinding.available else iobinding.reason


def cuda_graphs_enabled(provider: str, provider_options: Mapping[str, str]) -> bool:
    """Whether ``provider``'s options turn CUDA graphs on (``enable_cuda_graph=1``), and they can.

    They can where :func:`graphs_unavailable` has no reason against them.
    """
    return graphs_requested(provider, provider_options) and not graphs_unavailable(
        provider, provider_options
    )

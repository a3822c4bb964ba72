"""Execution-provider policy: what each provider needs so that N sessions can share weights.

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
- CUDA: a ``device_id`` (default 0) and ``use_ep_level_unified_stream=1`` (one stream per
  session: the pool never runs a session from two threads at once, and per-run streams each
  bring their own cuBLAS/cuDNN handles and workspaces, which cost device memory and bought no
  throughput where measured: ``docs/gpu.md``); weights are shared through the device weight
  store.
- CPU: always appended last as the fallback for nodes other providers do not take.
- Anything else passes through unchanged.

What was verified where (DirectML ran in software under Wine, not on Windows): README and
``docs/directml.md``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from sharedml._errors import ProviderError
from sharedml._host._onnxruntime import check_one_onnxruntime
from sharedml.runtime._capabilities import capability

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
    "ProviderPlan",
    "ProviderSpec",
    "available_providers",
    "plan_providers",
    "serialize_runs_by_default",
]

CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"
DML = "DmlExecutionProvider"

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
    """

    providers: tuple[str, ...]
    provider_options: tuple[dict[str, str], ...]
    config_entries: tuple[tuple[str, str], ...] = ()
    disable_mem_pattern: bool = False
    sequential_execution: bool = False

    @property
    def primary(self) -> str:
        """The provider that runs most of the graph."""
        return self.providers[0]

    @property
    def device_id(self) -> int:
        """The device of the primary provider (0 for CPU)."""
        return int(self.provider_options[0].get("device_id", 0))


def _normalize(
    providers: Sequence[ProviderSpec] | None,
    provider_options: Sequence[dict[str, Any]] | None,
) -> list[tuple[str, dict[str, str]]]:
    if providers is None:
        return [(CPU, {})]
    if isinstance(providers, str):
        providers = [providers]
    if provider_options is not None and len(provider_options) != len(providers):
        raise ProviderError(
            f"provider_options has {len(provider_options)} entries for {len(providers)} providers; "
            "give one dict per provider."
        )
    out: list[tuple[str, dict[str, str]]] = []
    for i, spec in enumerate(providers):
        if isinstance(spec, tuple):
            name, opts = spec
        else:
            name, opts = spec, {}
        if provider_options is not None:
            opts = {**opts, **provider_options[i]}
        out.append((name, {str(k): str(v) for k, v in opts.items()}))
    return out


def plan_providers(
    providers: Sequence[ProviderSpec] | None = None,
    provider_options: Sequence[dict[str, Any]] | None = None,
    *,
    available: Sequence[str] | None = None,
) -> ProviderPlan:
    """Apply the provider policy to what the caller asked for.

    Args:
        providers: As for ``onnxruntime.InferenceSession``: names or ``(name, options)`` pairs.
            ``None`` means CPU.
        provider_options: As for ``InferenceSession``: one dict per provider.
        available: The providers of the installed build (default: asked from onnxruntime).

    Returns:
        The plan every session of a pool is created with.

    Raises:
        ProviderError: a provider that this onnxruntime build does not have. ORT itself would
            warn and silently fall back to CPU; a pool of N sessions that silently runs on the
            CPU is a surprise worth an error.
    """
    requested = _normalize(providers, provider_options)
    if available is None:
        check_one_onnxruntime()  # the first place sharedml needs onnxruntime itself
    available = list(available) if available is not None else available_providers()
    names = [name for name, _ in requested]
    missing = [name for name in names if name not in available]
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
    )


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def serialize_runs_by_default(plan: ProviderPlan, ort_version: str | None = None) -> bool:
    """Whether runs must be serialized across the whole pool for this provider and version.

    DirectML on onnxruntime 1.18 and later: several sessions running on several threads at once
    hang or crash (ORT issue #20713, open); 1.17.3 worked.
    """
    if plan.primary != DML:
        return False
    if ort_version is None:
        import onnxruntime as ort

        ort_version = ort.__version__
    return _version_tuple(ort_version) >= (1, 18)


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

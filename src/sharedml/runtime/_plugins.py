"""Plugin execution providers: find each library, register it once per process, pick a device.

From onnxruntime 1.23 an execution provider can ship as a library of its own (WebGPU,
OpenVINO, TensorRT-RTX, Windows ML's catalog). ORT then behaves unlike its built-in providers,
and each difference is handled here once:

- A plugin EP never appears in ``get_available_providers()``, and ``providers=[name]`` only
  warns and runs on the CPU. Its library must be registered
  (``register_execution_provider_library``), then one of the ``OrtEpDevice`` objects it offers
  (``get_ep_devices()``) is added to a session's options (``add_provider_for_devices``); a
  session given ``providers=`` as well ignores those devices.
- Registration is per process and not idempotent: the same registration name twice raises
  ("already registered"), the same library under a second name registers it twice (every device
  listed twice). :func:`register_library` registers under the EP's own name, once per process,
  under a lock, and counts a library the caller registered first (its devices are listed) as
  registered. Child processes start with nothing registered: they register again from the
  provider plan's spec (:meth:`PluginDevice.to_dict`).
- Where the library is found: ``ep_libraries={name: path}`` (CLI ``--ep-library NAME=PATH``);
  else a library already registered in this process (by the caller, or Windows ML); else the
  package that ships it (:data:`KNOWN_PLUGINS`, its ``get_library_path()``).
- The device: the first the EP lists, unless a :class:`DeviceSelector` (hardware type, vendor,
  device id, index) or ``OrtEpDevice`` objects choose another. The choice is kept as a selector
  that pins the chosen device, so a child process picks the same one.

Thread safety: every function may be called from any thread; registration holds one lock.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from sharedml._errors import ProviderError

__all__ = [
    "KNOWN_PLUGINS",
    "SOFTWARE_ADAPTER_ENV",
    "WEBGPU",
    "DeviceSelector",
    "KnownPlugin",
    "PluginDevice",
    "ep_devices",
    "is_plugin",
    "plugin_api_missing",
    "register_library",
    "registered_libraries",
    "resolve_plugin",
]

WEBGPU = "WebGpuExecutionProvider"
# Read by the WebGPU library when it is registered (its strings, not its docs): without it the
# EP offers no device where the only adapter is a software one (Mesa's lavapipe, a VM, CI).
SOFTWARE_ADAPTER_ENV = "ORT_WEBGPU_EP_ALLOW_SOFTWARE_ADAPTER"


@dataclasses.dataclass(frozen=True)
class KnownPlugin:
    """A package on PyPI that ships a plugin EP's library.

    Attributes:
        module: The Python module whose ``get_library_path()`` gives the library.
        package: What to ``pip install``.
    """

    module: str
    package: str


# EP name (as the library's devices report it) -> the package that ships the library. The
# TensorRT-RTX plugin names its EP "nv_tensorrt_rtx" (its get_ep_name()), not the in-tree
# "NvTensorRTRTXExecutionProvider".
KNOWN_PLUGINS: Mapping[str, KnownPlugin] = {
    WEBGPU: KnownPlugin("onnxruntime_ep_webgpu", "onnxruntime-ep-webgpu"),
    "OpenVINOExecutionProvider": KnownPlugin("onnxruntime_ep_openvino", "onnxruntime-ep-openvino"),
    "nv_tensorrt_rtx": KnownPlugin(
        "onnxruntime_ep_nv_tensorrt_rtx", "onnxruntime-ep-nv-tensorrt-rtx"
    ),
}

_TYPES = ("cpu", "gpu", "npu")  # OrtHardwareDeviceType's members, lower case


@dataclasses.dataclass(frozen=True)
class DeviceSelector:
    """Which of a plugin EP's devices a pool runs on: every field given must match.

    ``DeviceSelector(type="gpu")`` takes the EP's first GPU, ``DeviceSelector(vendor="NVIDIA",
    index=1)`` its second NVIDIA device. Pass it per EP name: ``SessionPool(model,
    providers=["OpenVINOExecutionProvider"], ep_devices={"OpenVINOExecutionProvider":
    DeviceSelector(type="npu")})``. A selector is plain data: it travels to child processes and
    Ray replicas, where ``OrtEpDevice`` objects (which belong to one process) cannot.

    Attributes:
        type: ``"gpu"``, ``"npu"`` or ``"cpu"`` (the device's ``OrtHardwareDeviceType``).
        vendor: The hardware vendor's name as ORT reports it (``"NVIDIA"``), any case.
        vendor_id: The hardware vendor's PCI id (``0x10DE`` for NVIDIA).
        device_id: The hardware device's id as ORT reports it (a PCI device id: the model, so
            two cards of one model share it; tell them apart with ``index``).
        index: Of the devices that match, the one at this position in ORT's order (0: the
            first).
    """

    type: str | None = None
    vendor: str | None = None
    vendor_id: int | None = None
    device_id: int | None = None
    index: int = 0

    def __post_init__(self) -> None:
        if self.type is not None:
            kind = str(self.type).lower()
            if kind not in _TYPES:
                raise ValueError(
                    f"DeviceSelector type must be one of {', '.join(_TYPES)}, not {self.type!r}."
                )
            object.__setattr__(self, "type", kind)
        for name in ("vendor_id", "device_id", "index"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise TypeError(f"DeviceSelector {name} must be an integer, not {value!r}.")
            if value is not None and value < 0:
                raise ValueError(f"DeviceSelector {name} must be >= 0, not {value!r}.")

    @classmethod
    def parse(cls, text: str) -> DeviceSelector:
        """A selector from its command-line form.

        ``"gpu"`` (a type alone), or ``key=value`` pairs separated by commas:
        ``"type=gpu,vendor=NVIDIA,index=1"``; ids may be hexadecimal (``vendor_id=0x10de``).

        Raises:
            ValueError: an unknown key or a value of the wrong kind.
        """
        text = text.strip()
        if text.lower() in _TYPES:
            return cls(type=text)
        fields: dict[str, Any] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, value = part.partition("=")
            key = key.strip()
            if not sep or key not in ("type", "vendor", "vendor_id", "device_id", "index"):
                raise ValueError(
                    f"Device selector {text!r}: use a type (cpu, gpu, npu) or key=value pairs "
                    "of type, vendor, vendor_id, device_id and index, e.g. 'type=gpu,index=1'."
                )
            try:
                fields[key] = int(value, 0) if key in ("vendor_id", "device_id", "index") else value
            except ValueError:
                raise ValueError(
                    f"Device selector {text!r}: {key} must be a number, not {value!r}."
                ) from None
        return cls(**fields)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DeviceSelector:
        """The selector :meth:`to_dict` wrote."""
        return cls(**{k: v for k, v in data.items() if v is not None})

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (what a child process gets)."""
        return dataclasses.asdict(self)

    def matches(self, device: Any) -> bool:
        """Whether an ``OrtEpDevice``'s hardware fits every field given (``index`` aside)."""
        hw = device.device
        return (
            (self.type is None or _type_name(hw) == self.type)
            and (self.vendor is None or str(hw.vendor).lower() == self.vendor.lower())
            and (self.vendor_id is None or int(hw.vendor_id) == self.vendor_id)
            and (self.device_id is None or int(hw.device_id) == self.device_id)
        )

    def describe(self) -> str:
        """The fields given, as ``key=value`` pairs (``"any device"`` for none)."""
        parts = [
            f"{f.name}={_hex(v) if f.name.endswith('_id') else v}"
            for f in dataclasses.fields(self)
            if (v := getattr(self, f.name)) is not None and not (f.name == "index" and v == 0)
        ]
        return ",".join(parts) or "any device"


def _type_name(hw: Any) -> str:
    """``OrtHardwareDeviceType.GPU`` -> ``"gpu"``."""
    return str(getattr(hw.type, "name", hw.type)).rsplit(".", 1)[-1].lower()


def _hex(value: Any) -> str:
    return f"0x{int(value):x}"


def _describe_device(device: Any) -> str:
    hw = device.device
    return (
        f"the {_type_name(hw).upper()} device of {hw.vendor or 'an unknown vendor'} "
        f"(vendor_id {_hex(hw.vendor_id)}, device_id {_hex(hw.device_id)})"
    )


@dataclasses.dataclass(frozen=True)
class PluginDevice:
    """The library and device a plugin EP runs with in this process: plain, serializable data.

    Attributes:
        ep_name: The EP's name, as its devices report it.
        library: The library registered for it (None where it was registered before sharedml
            and ORT does not say from where).
        selector: Pins the chosen device (type, vendor_id, device_id, index), so that another
            process picks the same one.
        description: The device in words, for reasons and reports.
        found: How the library was found (``"ep_libraries"``, ``"package onnxruntime-ep-webgpu"``,
            ``"registered before sharedml"``).
    """

    ep_name: str
    library: str | None
    selector: DeviceSelector
    description: str
    found: str

    @property
    def key(self) -> str:
        """Names the device among every EP's devices (the run locks' key)."""
        s = self.selector
        return f"{self.ep_name}:{s.type}:{s.vendor_id}:{s.device_id}:{s.index}"

    def devices(self) -> list[Any]:
        """The ``OrtEpDevice`` to add to a session's options, looked up in this process.

        Raises:
            ProviderError: the device is gone (the library was unregistered meanwhile).
        """
        found = [d for d in ep_devices(self.ep_name) if self.selector.matches(d)]
        if len(found) <= self.selector.index:
            raise ProviderError(
                f"{self.ep_name}'s device {self.description} is no longer listed by onnxruntime "
                "(was its library unregistered?). Create the pool again."
            )
        return [found[self.selector.index]]


# Process-wide: what sharedml registered (or found registered), EP name -> library path (None:
# registered before sharedml, path unknown), and whether the software-adapter switch was set then.
_REGISTERED: dict[str, str | None] = {}
_SOFTWARE_AT_REGISTRATION: dict[str, bool] = {}
_LOCK = threading.RLock()


def plugin_api_missing() -> str:
    """Why this onnxruntime cannot use plugin EPs; "" where it can."""
    import onnxruntime as ort

    needed = ("register_execution_provider_library", "get_ep_devices")
    missing = [n for n in needed if not hasattr(ort, n)]
    if missing or not hasattr(ort.SessionOptions, "add_provider_for_devices"):
        return (
            f"onnxruntime {ort.__version__} cannot load plugin execution providers (it lacks "
            f"{', '.join(missing) or 'SessionOptions.add_provider_for_devices'}; new in 1.23)"
        )
    return ""


def ep_devices(ep_name: str) -> list[Any]:
    """The ``OrtEpDevice`` objects onnxruntime lists for ``ep_name``, in its order."""
    import onnxruntime as ort

    with _LOCK:
        return [d for d in ort.get_ep_devices() if d.ep_name == ep_name]


def is_plugin(ep_name: str) -> bool:
    """Whether ``ep_name`` runs from a plugin library registered in this process.

    From onnxruntime 1.32 a registered plugin EP is listed by ``get_available_providers()`` too,
    so that list cannot tell a plugin from a built-in provider; the devices can: a plugin's carry
    its library's path (``ep_metadata["library_path"]``).
    """
    if ep_name in _REGISTERED:
        return True
    if plugin_api_missing():
        return False
    return any("library_path" in dict(d.ep_metadata) for d in ep_devices(ep_name))


def registered_libraries() -> dict[str, str | None]:
    """The plugin libraries sharedml registered (or found registered) in this process."""
    with _LOCK:
        return dict(_REGISTERED)


def _software_switch() -> bool:
    return os.environ.get(SOFTWARE_ADAPTER_ENV, "").strip() == "1"


def register_library(ep_name: str, library: str | os.PathLike[str]) -> str:
    """Register ``library`` for ``ep_name`` once in this process; how it stands.

    A library the caller registered first is taken as it is: its devices are listed already, or
    ORT says that the EP's name is registered ("already registered").

    Args:
        ep_name: The EP's name, also the registration name.
        library: The library's path.

    Returns:
        ``"registered"``, ``"registered before"`` (by sharedml earlier in this process) or
        ``"registered before sharedml"``.

    Raises:
        ProviderError: the file is missing, is not a library, or is not a plugin EP library.
    """
    import onnxruntime as ort

    path = str(library)
    with _LOCK:
        if ep_name in _REGISTERED:
            return "registered before"
        if ep_devices(ep_name):  # the caller (or Windows ML) registered it first
            return _adopt(ep_name)
        if not Path(path).is_file():
            what = "is a folder" if Path(path).is_dir() else "does not exist"
            raise ProviderError(
                f"The library given for {ep_name}, '{path}', {what}. Give the path of the "
                "plugin's shared library file (.so, .dll or .dylib): ep_libraries={"
                f"'{ep_name}': PATH}} in Python, --ep-library {ep_name}=PATH on the command line."
            )
        try:
            ort.register_execution_provider_library(ep_name, path)
        except Exception as exc:  # ORT raises its own Fail type
            if "already registered" not in str(exc).lower():
                raise ProviderError(
                    f"onnxruntime could not register '{path}' as the library of {ep_name}: "
                    f"{_first_line(exc)}. Give the path of that execution provider's plugin "
                    "library (one that exports CreateEpFactories)."
                ) from None
            # Registered under this very name by the caller, and it offers no device: counted
            # as registered; the caller of resolve_plugin reports the missing device.
            _REGISTERED[ep_name] = None
            _SOFTWARE_AT_REGISTRATION[ep_name] = _software_switch()
            return "registered before sharedml"
        _REGISTERED[ep_name] = path
        _SOFTWARE_AT_REGISTRATION[ep_name] = _software_switch()
        return "registered"


def _adopt(ep_name: str) -> str:
    """Count a library registered before sharedml (its devices are listed) as registered."""
    with _LOCK:
        _REGISTERED[ep_name] = _listed_library(ep_name)
        _SOFTWARE_AT_REGISTRATION[ep_name] = _software_switch()
    return "registered before sharedml"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _listed_library(ep_name: str) -> str | None:
    """The library path ORT lists for ``ep_name``'s devices (their ``library_path``)."""
    for device in ep_devices(ep_name):
        path = dict(device.ep_metadata).get("library_path")
        if path:
            return str(path)
    return None


def _known_library(ep_name: str) -> str:
    """The library the known package of ``ep_name`` ships."""
    known = KNOWN_PLUGINS[ep_name]
    try:
        module = importlib.import_module(known.module)
    except ImportError:
        raise ProviderError(
            f"{ep_name} is a plugin execution provider, and its package is not installed: "
            f"pip install {known.package}"
        ) from None
    try:
        return str(module.get_library_path())
    except Exception as exc:  # the package's own checks (FileNotFoundError for a broken install)
        raise ProviderError(
            f"The {known.package} package did not give the library of {ep_name}: {exc}. "
            f"Reinstall it: pip install --force-reinstall {known.package}"
        ) from None


def resolve_plugin(
    ep_name: str,
    *,
    library: str | os.PathLike[str] | None = None,
    choice: DeviceSelector | Sequence[Any] | Any | None = None,
    available: Sequence[str] = (),
) -> PluginDevice:
    """Find, register and choose the device of the plugin EP ``ep_name``.

    Args:
        ep_name: The EP's name.
        library: Its library (``ep_libraries``); None: one registered already in this process,
            else its package's (:data:`KNOWN_PLUGINS`).
        choice: A :class:`DeviceSelector`, or ``OrtEpDevice`` objects of this EP (one, or a
            sequence whose first is taken); None: the first device the EP lists.
        available: The built-in providers, for the message where ``ep_name`` is neither.

    Returns:
        The library and device, as plain data.

    Raises:
        ProviderError: onnxruntime cannot load plugin EPs, the library cannot be found or
            registered, the EP offers no device here (the message names the cause and the fix),
            or none of its devices fits ``choice``.
    """
    missing_api = plugin_api_missing()
    known = ep_name in KNOWN_PLUGINS
    if missing_api and (library is not None or known):
        raise ProviderError(f"{ep_name} is a plugin execution provider, but {missing_api}.")
    with _LOCK:
        if library is not None:
            how = register_library(ep_name, library)
            found = "ep_libraries" if how == "registered" else how
        elif ep_name in _REGISTERED:
            found = "registered before"
        elif not missing_api and ep_devices(ep_name):
            found = _adopt(ep_name)
        elif known:
            how = register_library(ep_name, _known_library(ep_name))
            found = f"package {KNOWN_PLUGINS[ep_name].package}" if how == "registered" else how
        else:
            raise ProviderError(_unknown_message(ep_name, available, missing_api))
        listed = ep_devices(ep_name)
        path = _REGISTERED.get(ep_name)
    if found == "registered before":  # by sharedml, earlier in this process
        found = "registered by sharedml earlier in this process"
    if not listed:
        raise ProviderError(_no_device_message(ep_name, path))
    device, index = _choose(ep_name, listed, choice)
    hw = device.device
    selector = DeviceSelector(
        type=_type_name(hw), vendor_id=int(hw.vendor_id), device_id=int(hw.device_id), index=index
    )
    return PluginDevice(
        ep_name=ep_name,
        library=path,
        selector=selector,
        description=_describe_device(device),
        found=found,
    )


def _choose(
    ep_name: str, listed: Sequence[Any], choice: DeviceSelector | Sequence[Any] | Any | None
) -> tuple[Any, int]:
    """The chosen device, and its index among the listed devices of its own kind."""
    if choice is None:
        device = listed[0]
    elif isinstance(choice, DeviceSelector):
        fits = [d for d in listed if choice.matches(d)]
        if len(fits) <= choice.index:
            offered = "; ".join(_describe_device(d) for d in listed)
            raise ProviderError(
                f"No device of {ep_name} fits {choice.describe()} (it offers: {offered}). "
                "Choose one of those with DeviceSelector(type=..., vendor=..., vendor_id=..., "
                "device_id=..., index=...), or leave ep_devices out for the first."
            )
        device = fits[choice.index]
    else:
        chosen = list(choice) if isinstance(choice, (list, tuple)) else [choice]
        if not chosen or any(getattr(d, "ep_name", None) != ep_name for d in chosen):
            raise ProviderError(
                f"ep_devices for {ep_name} must be a DeviceSelector or OrtEpDevice objects of "
                f"{ep_name} (from onnxruntime.get_ep_devices()), not {choice!r}."
            )
        device = _same_listed(chosen[0], listed, ep_name)
    hw = device.device
    pinned = DeviceSelector(
        type=_type_name(hw), vendor_id=int(hw.vendor_id), device_id=int(hw.device_id)
    )
    twins = [d for d in listed if pinned.matches(d)]
    return device, next(i for i, d in enumerate(twins) if d is device)


def _same_listed(given: Any, listed: Sequence[Any], ep_name: str) -> Any:
    """The listed device that ``given`` (an ``OrtEpDevice`` from the caller) is.

    ORT hands out a new Python object for the same device on every ``get_ep_devices()`` call;
    devices are told apart by their hardware and metadata.
    """

    def identity(d: Any) -> tuple[Any, ...]:
        hw = d.device
        return (
            _type_name(hw),
            int(hw.vendor_id),
            int(hw.device_id),
            tuple(sorted(dict(hw.metadata).items())),
            tuple(sorted(dict(d.ep_metadata).items())),
        )

    for device in listed:
        if device is given or identity(device) == identity(given):
            return device
    raise ProviderError(
        f"The OrtEpDevice given for {ep_name} ({_describe_device(given)}) is not one that "
        "onnxruntime lists in this process; take it from onnxruntime.get_ep_devices() here."
    )


def _unknown_message(ep_name: str, available: Sequence[str], missing_api: str) -> str:
    known = ", ".join(f"{name} ({k.package})" for name, k in KNOWN_PLUGINS.items())
    text = (
        f"Execution provider {ep_name} is not available: it is not built into this onnxruntime "
        f"(available: {', '.join(available) or 'none'}) and no plugin library is registered "
        f"for it. "
    )
    if missing_api:
        return text + f"Plugin execution providers need a newer onnxruntime: {missing_api}."
    return text + (
        f"Give its plugin library: ep_libraries={{'{ep_name}': PATH}} in Python, --ep-library "
        f"{ep_name}=PATH on the command line. sharedml finds these by their packages: {known}."
    )


def _no_device_message(ep_name: str, library: str | None) -> str:
    where = f"'{library}'" if library else "its library"
    if ep_name == WEBGPU:
        switch_now = _software_switch()
        switch_then = _SOFTWARE_AT_REGISTRATION.get(ep_name, switch_now)
        if switch_now and not switch_then:
            return (
                f"{ep_name} offers no device: its library was registered in this process "
                f"before {SOFTWARE_ADAPTER_ENV}=1 was set, and the library reads it only then. "
                "Set it in the environment before the process starts."
            )
        if not switch_now:
            return (
                f"{ep_name} offers no device: WebGPU found no GPU adapter. On a machine whose "
                "only adapter is a software one (no GPU: a VM, CI, Mesa's lavapipe), set "
                f"{SOFTWARE_ADAPTER_ENV}=1 in the environment before the process starts; "
                "otherwise install the GPU's driver (Vulkan on Linux, Direct3D 12 on Windows, "
                "Metal on macOS)."
            )
        return (
            f"{ep_name} offers no device even with {SOFTWARE_ADAPTER_ENV}=1: no Vulkan (Linux), "
            "Direct3D 12 (Windows) or Metal (macOS) adapter answered. Install the GPU's driver, "
            "or Mesa's software Vulkan driver (Debian: libvulkan1 and mesa-vulkan-drivers, "
            "Mesa 25 or newer); `vulkaninfo --summary` shows what Vulkan sees."
        )
    hint = ""
    if ep_name == "OpenVINOExecutionProvider":
        hint = " OpenVINO's plugin offers devices on Intel hardware only."
    return (
        f"{ep_name} offers no device on this machine: {where} is registered, and "
        f"onnxruntime.get_ep_devices() lists no device for it (the provider found no hardware "
        f"it supports).{hint}"
    )

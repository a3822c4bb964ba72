"""The execution-provider flags that ``sharedml inspect`` and ``sharedml serve`` share."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

__all__ = ["add_provider_arguments", "parse_ep_items", "provider_options"]


def add_provider_arguments(p: argparse.ArgumentParser, *, providers_help: str) -> None:
    """``--providers``, ``--ep-library`` and ``--ep-device`` on ``p``."""
    p.add_argument("--providers", nargs="+", default=None, metavar="P", help=providers_help)
    p.add_argument(
        "--ep-library",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="the library of a plugin execution provider that sharedml does not find itself "
        "(it finds onnxruntime-ep-webgpu's, -openvino's, -nv-tensorrt-rtx's); repeatable",
    )
    p.add_argument(
        "--ep-device",
        action="append",
        default=[],
        metavar="NAME=SELECTOR",
        help="a plugin execution provider's device: a type (gpu, npu, cpu) or key=value pairs of "
        "type, vendor, vendor_id, device_id, index, e.g. OpenVINOExecutionProvider=type=npu "
        "(default: the first device it lists); repeatable",
    )


def parse_ep_items(flag: str, items: Sequence[str]) -> dict[str, str]:
    """``["NAME=VALUE", ...]`` of ``--ep-library`` / ``--ep-device`` -> ``{NAME: VALUE}``.

    Raises:
        ValueError: an item that is not ``NAME=VALUE``, or a name given twice.
    """
    found: dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition("=")
        name, value = name.strip(), value.strip()
        if not sep or not name or not value:
            raise ValueError(
                f"{flag} {item!r}: expected NAME=VALUE, e.g. {flag} "
                "WebGpuExecutionProvider=" + ("/path/to/library.so" if "library" in flag else "gpu")
            )
        if name in found:
            raise ValueError(f"{flag} names {name} twice; give it once.")
        found[name] = value
    return found


def provider_options(args: argparse.Namespace) -> dict[str, Any]:
    """``providers``, ``ep_libraries`` and ``ep_devices`` as a pool takes them (given ones only).

    Raises:
        ValueError: a malformed ``--ep-*`` item, or one without ``--providers``.
    """
    libraries = parse_ep_items("--ep-library", args.ep_library)
    devices = parse_ep_items("--ep-device", args.ep_device)
    if (libraries or devices) and not args.providers:
        raise ValueError(
            "--ep-library and --ep-device name a plugin execution provider: ask for it with "
            "--providers NAME too."
        )
    options: dict[str, Any] = {}
    if args.providers is not None:
        options["providers"] = args.providers
    if libraries:
        options["ep_libraries"] = libraries
    if devices:
        options["ep_devices"] = devices
    return options

"""Which onnxruntime distributions are installed, read without importing onnxruntime."""

from __future__ import annotations

import functools
import os
import re
import warnings
from pathlib import Path

__all__ = [
    "ORT_DISTRIBUTIONS",
    "check_one_onnxruntime",
    "onnxruntime_distributions",
    "onnxruntime_site",
]

# Distributions that install the `onnxruntime` package: any two of them overwrite each other's
# files, so which build `import onnxruntime` gets depends on install order.
ORT_DISTRIBUTIONS = (
    "onnxruntime",
    "onnxruntime-gpu",
    "onnxruntime-directml",
    "onnxruntime-openvino",
    "onnxruntime-qnn",
    "onnxruntime-rocm",
    "onnxruntime-migraphx",
    "onnxruntime-cann",
    "onnxruntime-training",
    "ort-nightly",
    "ort-nightly-gpu",
    "ort-nightly-directml",
)
_ORT_PREFIXES = ("onnxruntime", "ort-nightly")  # of the records' folder names, normalized


def onnxruntime_site() -> Path | None:
    """The folder the ``onnxruntime`` package would be imported from, without importing it."""
    import importlib.util

    spec = importlib.util.find_spec("onnxruntime")
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent.parent


def onnxruntime_distributions(site: Path | None = None) -> list[tuple[str, str]]:
    """``(name, version)`` of each distribution in ``site`` that provides ``onnxruntime``.

    Args:
        site: a site folder; default: the one ``onnxruntime`` would be imported from
            (:func:`onnxruntime_site`). Distributions in other folders of ``sys.path`` are left
            out: sys.path order decides between folders, and a package shadowed that way cannot
            mix with the one imported. Two in one folder wrote their files over each other.
    """
    import importlib.metadata as metadata

    site = site if site is not None else onnxruntime_site()
    if site is None:
        return []
    found: dict[str, str] = {}
    # Only the records whose folder name can be one of ours are parsed: reading every
    # distribution's metadata costs 0.1 s in a venv of 100 packages, on every pool's start.
    try:
        records = [
            entry
            for entry in os.scandir(site)
            if entry.name.endswith((".dist-info", ".egg-info"))
            and re.sub(r"[-_.]+", "-", entry.name.lower()).startswith(_ORT_PREFIXES)
        ]
    except OSError:
        return []
    for record in sorted(records, key=lambda e: e.name):
        dist = metadata.PathDistribution(Path(record.path))
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name in ORT_DISTRIBUTIONS:
            found.setdefault(name, dist.version)
    return sorted(found.items(), key=lambda item: ORT_DISTRIBUTIONS.index(item[0]))


@functools.cache
def check_one_onnxruntime() -> str | None:
    """Warn (once per process) when two onnxruntime distributions share one folder; say the fix.

    Called where sharedml first needs onnxruntime (planning a pool's or a measurement's
    providers), not at ``import sharedml``. A warning, not an error: the mixed install may still
    work for what the user runs, but it is an accident of install order (``pip install
    onnxruntime-gpu`` next to ``onnxruntime`` leaves whichever came last, in part). A build
    installed in a folder of its own ahead on ``sys.path`` (``pip install --target``) is not
    mixed, and is not warned of.

    Returns:
        The warning's text, or None when at most one is installed there.
    """
    site = onnxruntime_site()
    found = onnxruntime_distributions(site)
    if len(found) < 2:
        return None
    listed = ", ".join(f"{name} {version}" for name, version in found)
    names = " ".join(name for name, _ in found)
    keep = next((name for name, _ in found if name != "onnxruntime"), found[0][0])
    message = (
        f"sharedml: {len(found)} onnxruntime distributions are installed in {site} ({listed}); "
        "they all write the same 'onnxruntime' package, so the build you get (and its execution "
        f"providers) depends on install order. Keep exactly one: pip uninstall -y {names} && "
        f"pip install {keep} (README, Install)."
    )
    warnings.warn(message, RuntimeWarning, stacklevel=3)
    return message

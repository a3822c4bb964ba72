"""Which CPU route a pool's sessions take to their weights: ORT's saved prepacked model, or raw.

Route policy over figures the weights stage measures: :mod:`sharedml.weights._prepacked` builds
the saved model and counts what it holds (:class:`~sharedml.weights._prepacked.PrepackStats`);
:func:`choose_cpu_route` weighs those figures against the sessions a pool holds and the
per-process map limit. The planner (:mod:`sharedml.route._planner`) asks it once per pool.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import TYPE_CHECKING

from sharedml._host import _platform

if TYPE_CHECKING:
    from sharedml.weights._prepacked import PrepackStats

__all__ = ["SESSION_PACK_LIMIT_BYTES", "CpuRoute", "CpuRouteDecision", "choose_cpu_route"]

# Where ORT packs weights that no saved model shares, each session packs its own (plain ORT's
# numerics) if that costs a session at most this (plus twice the packs counted), else prepacking
# stays off: the packs counted are small by definition, but kernels that save no packed form
# (int8 QLinearConv in NHWC) pack too, and a static int8 CNN's pool of 4 then held 28.5 MiB
# instead of 12.8 (plain int8 sessions: 22.6). Bytes.
SESSION_PACK_LIMIT_BYTES = 2**20


class CpuRoute(enum.Enum):
    """How a pool gives its CPU sessions their weights."""

    PREPACKED_FILE = "prepacked-file"
    """Sessions load :attr:`~sharedml.weights._prepacked.PrepackedModel.model_path` after
    :meth:`~sharedml.weights._prepacked.PrepackedModel.apply`: raw, derived and packed weights
    are mapped from one file, once for all sessions; packed speed."""

    SHARED_RAW = "shared-raw"
    """Sessions borrow the raw weights zero-copy with ``session.disable_prepacking=1``: one copy,
    near-zero session creation time, unpacked kernels."""


@dataclasses.dataclass(frozen=True)
class CpuRouteDecision:
    """The route :func:`choose_cpu_route` picked, and why (one sentence, for logs and reports).

    Attributes:
        route: The route.
        reason: Why, in a sentence.
        packs_per_session: On ``SHARED_RAW``: ORT packs weights of this model (or may: it
            could not be told) that no saved model shares, so each session should pack its
            own copy (``prepacking="per-session"``): with prepacking off those kernels would
            run unpacked, and compute other values than plain ORT.
    """

    route: CpuRoute
    reason: str
    packs_per_session: bool = False


def choose_cpu_route(
    stats: PrepackStats,
    *,
    sessions: int,
    max_map_count: int | None = None,
    block_quantized: bool = False,
) -> CpuRouteDecision:
    """Pick the CPU weight route for ``sessions`` sessions of one model.

    PREPACKED_FILE wherever ORT packs or derives anything: memory is then about that of
    SHARED_RAW, or far less where the optimizers derive weights (each shared-raw session keeps
    its own derived copies), and packed kernels are faster as soon as a MatMul has more than one
    row. The costs are disk (about twice the weights), a one-off build, and slower session
    creation (ORT packs again to validate); hence SHARED_RAW when there is nothing to gain, or
    when the file maps of all sessions would crowd the kernel's per-process map limit. Figures:
    ``docs/cpu-prepacking.md``.

    Args:
        stats: From :func:`~sharedml.weights._prepacked.inspect_prepacked_model` or
            ``PrepackedModel.stats``.
        sessions: How many sessions of this model the process will hold at most.
        max_map_count: The per-process memory-map limit; None reads ``vm.max_map_count``.
        block_quantized: The model has ``MatMulNBits`` kernels. ORT always packs their
            weights, but before onnxruntime 1.28 it saves no packed form of them (measured:
            1.24-1.27 saved none, 1.28 and later do), so no saved blob does not mean no pack.

    Where ORT saved no blob, ``stats.inline_packed_blobs`` tells whether it packs weights the
    saved model keeps inline: then (or where that could not be told) ``SHARED_RAW`` with
    ``packs_per_session``, so that those kernels run packed as in plain ORT. With prepacking
    off they ran unpacked: a 1-D U-Net's ConvTranspose at a bottleneck of length 1 gave
    outputs 5.7e-6 away from plain ORT's, bitwise equal with each session packing.

    Returns:
        The route and a one-sentence reason.
    """
    if stats.prepacked_bytes == 0 and stats.derived_bytes == 0 and block_quantized:
        return CpuRouteDecision(
            CpuRoute.SHARED_RAW,
            "ORT saved no packed form of this model's MatMulNBits weights (onnxruntime before "
            "1.28 packs them in each session and saves nothing), so the saved copy would only "
            "double the disk use.",
        )
    inline = stats.inline_packed_blobs
    if stats.prepacked_bytes == 0 and stats.derived_bytes == 0 and inline != 0:
        what = (
            "whether ORT packs weights of this model that its saved model keeps inline could "
            "not be told (it saved no packed form of any)"
            if inline is None
            else f"ORT packs {inline} weight(s) of this model "
            f"({(stats.inline_packed_bytes or 0) / 2**10:.1f} KiB packed), each too small for "
            "the saved model's data file, where alone a packed form is shared, and derives none"
        )
        cost = stats.session_pack_bytes
        limit = SESSION_PACK_LIMIT_BYTES + 2 * (stats.inline_packed_bytes or 0)
        if cost is not None and cost <= limit:
            return CpuRouteDecision(
                CpuRoute.SHARED_RAW,
                f"{what[:1].upper()}{what[1:]}: each session packs its own copy, as plain ORT "
                f"does (the same kernels, the same values; {cost / 2**20:.1f} MiB a session), "
                "over the shared raw weights.",
                packs_per_session=True,
            )
        costs = (
            "could not be measured"
            if cost is None
            else f"cost each session {cost / 2**20:.1f} MiB (kernels that save no packed form "
            "pack too)"
        )
        return CpuRouteDecision(
            CpuRoute.SHARED_RAW,
            f"{what[:1].upper()}{what[1:]}; packing in every session {costs}, so prepacking is "
            "off: those kernels run unpacked, and outputs may differ from plain ORT's by "
            "rounding (prepacking='per-session' gives plain ORT's values at that cost).",
        )
    if stats.prepacked_bytes == 0 and stats.derived_bytes == 0:
        return CpuRouteDecision(
            CpuRoute.SHARED_RAW,
            "ORT saves no packed form of any weight of this model on this CPU, at any size, "
            "and derives none, so the saved copy would only double the disk use and slow "
            "session creation.",
        )
    limit = max_map_count if max_map_count is not None else _platform.max_map_count()
    maps = stats.maps_per_session * sessions
    if maps > limit // 2:  # leave half the limit to the rest of the process
        return CpuRouteDecision(
            CpuRoute.SHARED_RAW,
            f"{sessions} sessions would make {maps} memory maps of the data file, over half of "
            f"vm.max_map_count ({limit}); raise min_external_bytes or vm.max_map_count.",
        )
    derived = (
        f"{stats.derived_bytes / 2**20:.1f} MiB of weights that ORT's optimizers derive (fused, "
        "folded or dequantized)"
    )
    if stats.prepacked_blobs == 0:
        packs = (
            f"ORT packs {inline} small weight(s) of this model in each session, as plain ORT "
            "does, and saves no packed form of any; "
            if inline
            else "ORT packs no weight of this model on this CPU, but "
        )
        return CpuRouteDecision(
            CpuRoute.PREPACKED_FILE,
            f"{packs}its saved optimized model carries {derived}: mapped once for every "
            "session (mechanism 'optimized-file').",
        )
    what = f"{stats.prepacked_blobs} prepacked blobs ({stats.prepacked_bytes / 2**20:.1f} MiB)"
    if stats.derived_bytes:
        what += f" and {derived}"
    return CpuRouteDecision(CpuRoute.PREPACKED_FILE, f"{what} are mapped once for every session.")

"""What a route is planned from: the words for it, and the settings that travel together.

:class:`Mechanism` and :class:`Prepacking` name how sessions get the weights and what happens
to ORT's prepacking. A pool's keyword arguments reach the planner in two groups, each checked
once, where it is built, before anything is prepared: :class:`SessionSettings` (what each
session's options start from) and :class:`WeightsSettings` (where the weights come from and
how they are lent). :class:`RouteOptions` adds the providers and the most sessions: everything
:func:`~sharedml.route._planner.plan_route` takes besides the model.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from typing import Any

from sharedml.cache._root import CacheDir
from sharedml.prepared._compress import WeightsFormat
from sharedml.prepared._plan import check_threshold
from sharedml.runtime._providers import ProviderPlan

__all__ = [
    "SAVED_MODEL",
    "Mechanism",
    "Prepacking",
    "RouteOptions",
    "SessionSettings",
    "WeightsSettings",
]


class Mechanism(str, enum.Enum):
    """How a pool's sessions get the one copy of the weights (``pool.mechanism``).

    A ``str`` enum: ``pool.mechanism == "device"`` works.
    """

    PREPACKED_FILE = "prepacked-file"
    """CPU: sessions load ORT's saved prepacked model by path and map its data file: raw,
    derived and prepacked weights, one copy."""
    OPTIMIZED_FILE = "optimized-file"
    """CPU: as ``prepacked-file``, for a model ORT packs nothing of: the saved optimized model
    shares the weights ORT's optimizers derive (fused, folded, dequantized), one copy."""
    IN_MEMORY_FILE = "in-memory-file"
    """CPU: the mapped weights file is lent whole to every session (ORT's in-memory external
    data files, with ``session.use_external_initializer_file_buffers_directly=1``)."""
    ADD_INITIALIZER = "add-initializer"
    """CPU: each tensor is lent as an ``OrtValue`` over a slice of the map (``add_initializer``)."""
    ORT_MMAP = "ort-mmap"
    """CPU: ORT maps the weights file itself; sessions share the page cache."""
    DEVICE = "device"
    """GPU: weights uploaded once per device, every session borrows the device buffers."""

    def __str__(self) -> str:
        return self.value


SAVED_MODEL = (Mechanism.PREPACKED_FILE, Mechanism.OPTIMIZED_FILE)  # chosen, never requested


class Prepacking(str, enum.Enum):
    """What to do with ORT's CPU weight prepacking (``SessionPool(prepacking=...)``)."""

    AUTO = "auto"
    """Share the packed weights too where ORT packs or derives any weight, else raw weights."""
    SHARED = "shared"
    """The prepacked-file route, or an error if it cannot be built."""
    OFF = "off"
    """Share raw weights with prepacking off: least memory, unpacked kernels."""
    PER_SESSION = "per-session"
    """ORT's own behaviour: each session packs a private copy of every packed weight."""

    @classmethod
    def parse(cls, value: object) -> Prepacking:
        """One of the values, by its name (``"auto"``, ``"shared"``, ``"off"``, ``"per-session"``).

        Raises:
            ValueError: anything else; ``None``, ``False`` and ``True`` with the name to write.
        """
        if isinstance(value, bool) or value is None:
            # True reads as "share the packed weights" to a user of a sharing library, and
            # meant each session's private copy: the message names both.
            instead = {
                None: "'auto' (the default: leave it out)",
                False: "'off' (no prepacking)",
                True: "'per-session' (each session packs a private copy) or 'shared' (one packed "
                "copy for every session)",
            }[value]
            raise ValueError(f"prepacking={value!r} is not a setting: write prepacking={instead}.")
        try:
            return cls(value)
        except ValueError:
            raise ValueError(
                f"prepacking must be 'auto', 'shared', 'off' or 'per-session', not {value!r}."
            ) from None


def _parse_mechanism(value: object) -> Mechanism | None:
    """``"auto"`` -> None (the planner chooses); a name -> its Mechanism.

    The saved-model mechanisms are refused here: the planner chooses them, and a session told
    to borrow raw weights that way would fail only when created.
    """
    if value == "auto":
        return None
    try:
        found = Mechanism(value)
    except ValueError:
        found = None
    if found is None or found in SAVED_MODEL:
        names = ", ".join(repr(m.value) for m in Mechanism if m not in SAVED_MODEL)
        chosen = " (prepacking='shared' asks for the saved model)" if found else ""
        raise ValueError(f"mechanism must be 'auto' or one of {names}, not {value!r}{chosen}.")
    return found


@dataclasses.dataclass(frozen=True)
class SessionSettings:
    """What each session's ``SessionOptions`` start from (``SessionPool``'s arguments).

    Attributes:
        sess_options: The caller's template ``SessionOptions`` (never modified), or None.
        configure: Called with each session's options before creation, or None.
        cores: The CPU cores the sessions share (None: this process's usable cores): each CPU
            session gets ``cores // max_sessions`` intra-op threads unless the template sets a
            count.
    """

    sess_options: Any = None
    configure: Callable[[Any], None] | None = None
    cores: int | None = None


@dataclasses.dataclass(frozen=True)
class WeightsSettings:
    """Where a pool's weights come from, and how its sessions borrow them.

    Build it with :meth:`parse` from ``SessionPool``'s spellings; the fields hold the parsed
    values.

    Attributes:
        mechanism: The mechanism asked for; None: ``"auto"``, the planner chooses.
        prepacking: What to do with ORT's CPU prepacking.
        weights_format: ``FLOAT`` (the model's own weights), or compressed MatMul/Gemm weights.
        verify_weights: Check the weights' SHA-256 when first mapped in the process.
        size_threshold_bytes: Passed to prepare for models it prepares (None: its default).
        cache_dir: The cache: a path, a :class:`~sharedml.cache.Cache`, or None for
            :func:`sharedml.cache_dir` (resolved once, where the model is opened).

    Raises:
        ValueError: ``prepacking="shared"`` with a mechanism named.
    """

    mechanism: Mechanism | None = None
    prepacking: Prepacking = Prepacking.AUTO
    weights_format: WeightsFormat = WeightsFormat.FLOAT
    verify_weights: bool = True
    size_threshold_bytes: int | None = None
    cache_dir: CacheDir = None

    def __post_init__(self) -> None:
        if self.prepacking is Prepacking.SHARED and self.mechanism is not None:
            raise ValueError(
                "prepacking='shared' chooses the weight mechanism itself; leave mechanism='auto'."
            )

    @classmethod
    def parse(
        cls,
        *,
        mechanism: object = "auto",
        prepacking: object = "auto",
        weights: object = "float",
        verify_weights: bool = True,
        size_threshold_bytes: object = None,
        cache_dir: CacheDir = None,
    ) -> WeightsSettings:
        """The settings ``SessionPool(mechanism=, prepacking=, weights=, ...)`` spell, checked.

        Raises:
            ValueError: an unknown mechanism, prepacking or weights format, a threshold that
                is not a whole number of bytes, or a combination that contradicts itself.
        """
        return cls(
            mechanism=_parse_mechanism(mechanism),
            prepacking=Prepacking.parse(prepacking),
            weights_format=WeightsFormat.parse(weights),
            verify_weights=verify_weights,
            size_threshold_bytes=(
                None if size_threshold_bytes is None else check_threshold(size_threshold_bytes)
            ),
            cache_dir=cache_dir,
        )


@dataclasses.dataclass(frozen=True)
class RouteOptions:
    """Everything :func:`~sharedml.route._planner.plan_route` routes a model with.

    Attributes:
        plan: The providers (:func:`sharedml.runtime._providers.plan_providers`).
        max_sessions: The most sessions that will exist at once (threads and map budget).
        session: What each session's options start from.
        weights: Where the weights come from and how they are lent.
    """

    plan: ProviderPlan
    max_sessions: int
    session: SessionSettings = dataclasses.field(default_factory=SessionSettings)
    weights: WeightsSettings = dataclasses.field(default_factory=WeightsSettings)

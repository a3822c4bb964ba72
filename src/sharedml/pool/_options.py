"""A pool's arguments, checked once (PoolOptions), and what they make it (PoolPlan).

``SessionPool(model, **arguments)`` turns its keyword arguments into one frozen
:class:`PoolOptions` (:meth:`PoolOptions.from_arguments`: every argument checked before
anything is prepared, mapped or created), in the groups that travel together to one place:
the providers (:class:`~sharedml.runtime._providers.ProviderSettings`), what each session's
options start from (:class:`~sharedml.route._options.SessionSettings`) and the weights
(:class:`~sharedml.route._options.WeightsSettings`). ``sharedml serve`` and ``sharedml.ray``
build one and pass it on whole.

:func:`plan_pool` is a pure function of the options, the provider plan and the cores: how
many sessions, whether requests may merge, how sessions are created, and the
:class:`~sharedml.route._options.RouteOptions` the planner routes the model with. The pool then
only carries the plan out.
"""

from __future__ import annotations

import dataclasses
import operator
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from sharedml.cache._root import CacheDir
from sharedml.pool._arena import without_memory_patterns
from sharedml.pool._batching import Batching, BatchingDefault, BatchingSetting
from sharedml.route._options import RouteOptions, SessionSettings, WeightsSettings
from sharedml.runtime._providers import (
    CPU,
    DML,
    ProviderPlan,
    ProviderSettings,
    ProviderSpec,
    RunsRule,
    cuda_graphs_enabled,
    runs_rule,
)

__all__ = [
    "BATCHING_THREADS",
    "DEFAULT_SESSIONS",
    "PoolOptions",
    "PoolPlan",
    "batching_split",
    "plan_pool",
]

DEFAULT_SESSIONS = 4  # sessions in a pool whose provider runs Runs side by side

# A CPU pool whose requests merge, and whose count nothing set, gives each session at least this
# many intra-op threads (all the cores, where fewer). Measured (docs/batching.md, the default
# split): one session of every core served 1 and 16 callers at least as well as 4 sessions
# splitting the cores, on 2 cores (four one-thread sessions: 0.42-0.74x of the best alternative)
# and on 16 (four of four threads: 0.45-0.72x). Not measured beyond 16 cores: there the sessions
# keep 16 threads each, at most DEFAULT_SESSIONS of them.
BATCHING_THREADS = 16
_SERIALIZED_SESSIONS = 1  # where Runs cannot overlap, more sessions buy no concurrency

# The most sessions a pool takes: far beyond what any host holds (each session keeps its own
# activations and threads), and far below what overflows a C size (2**63 raised OverflowError
# deep inside the pool, not a message about the argument).
_MAX_SESSIONS = 1 << 16

BatchingChoice = Batching | Literal["auto"] | BatchingDefault | None
"""A parsed ``batching=``: its settings, ``"auto"``, left out, or None for ``False``."""


def _count_argument(name: str, value: object, *, minimum: int, also: str = "") -> int:
    """A count of sessions, checked; ``also`` names another spelling the argument takes."""
    try:
        count = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{name} must be an integer{also}, not {value!r}.") from None
    if isinstance(value, bool) or not minimum <= count <= _MAX_SESSIONS:
        raise ValueError(
            f"{name} must be an integer from {minimum} to {_MAX_SESSIONS}{also}, not {value!r}."
        )
    return count


@dataclasses.dataclass(frozen=True)
class PoolOptions:
    """``SessionPool``'s keyword arguments, checked and grouped (see ``SessionPool`` for each).

    Build it with :meth:`from_arguments`, which takes ``SessionPool``'s spellings.

    Attributes:
        sessions: A count, ``"auto"``, or None for the provider table's default.
        min_sessions: Sessions created up front (None: all of them).
        max_sessions: The most sessions (None: ``sessions``).
        batching: The parsed ``batching=``: a :class:`~sharedml.Batching`, ``"auto"``,
            ``BatchingDefault.BY_PROVIDER`` (left out), or None (``False``: never merge).
        per_session_state: Each caller needs a session of its own (no warning for extra
            sessions where runs are serialized).
        create_in_background: Return once the first session exists.
        serialize_creation: Create one session at a time, process-wide.
        providers: The providers, their options and plugin EPs, and the rule on runs.
        session: What each session's options start from, and the cores.
        weights: Where the weights come from and how they are lent.
    """

    sessions: int | Literal["auto"] | None = None
    min_sessions: int | None = None
    max_sessions: int | None = None
    batching: BatchingChoice = BatchingDefault.BY_PROVIDER
    per_session_state: bool = False
    create_in_background: bool = True
    serialize_creation: bool = True
    providers: ProviderSettings = dataclasses.field(default_factory=ProviderSettings)
    session: SessionSettings = dataclasses.field(default_factory=SessionSettings)
    weights: WeightsSettings = dataclasses.field(default_factory=WeightsSettings)

    @property
    def auto_sessions(self) -> bool:
        """``sessions="auto"``: calibration chooses the count and the threads."""
        return self.sessions == "auto"

    @classmethod
    def from_arguments(
        cls,
        *,
        sessions: int | Literal["auto"] | None = None,
        min_sessions: int | None = None,
        max_sessions: int | None = None,
        providers: Sequence[ProviderSpec] | None = None,
        provider_options: Sequence[dict[str, Any]] | None = None,
        sess_options: Any | None = None,
        configure: Callable[[Any], None] | None = None,
        mechanism: str = "auto",
        prepacking: str = "auto",
        batching: BatchingSetting | BatchingDefault = BatchingDefault.BY_PROVIDER,
        per_session_state: bool = False,
        create_in_background: bool = True,
        cache_dir: CacheDir = None,
        verify_weights: bool = True,
        serialize_creation: bool = True,
        serialize_runs: bool | None = None,
        size_threshold_bytes: int | None = None,
        weights: str = "float",
        cores: int | None = None,
        ep_libraries: Mapping[str, str | os.PathLike[str]] | None = None,
        ep_devices: Mapping[str, Any] | None = None,
    ) -> PoolOptions:
        """``SessionPool``'s arguments, checked: nothing is read, prepared or created.

        Raises:
            TypeError: a count that is not an integer.
            ValueError: a value out of range or unknown, or arguments that contradict each
                other (``sessions="auto"`` with ``min_sessions`` or ``max_sessions``).
        """
        auto = isinstance(sessions, str) and sessions == "auto"
        if auto and (min_sessions is not None or max_sessions is not None):
            given = " and ".join(
                f"{name}={value!r}"
                for name, value in (("min_sessions", min_sessions), ("max_sessions", max_sessions))
                if value is not None
            )
            raise ValueError(
                f"sessions='auto' with {given}: 'auto' chooses the number of sessions itself. "
                "Leave min_sessions and max_sessions out, or give sessions a number."
            )
        counts = {
            name: _count_argument(name, value, minimum=minimum, also=also)
            for name, value, minimum, also in (
                ("cores", cores, 1, ""),
                ("sessions", None if auto else sessions, 1, " or 'auto'"),
                ("max_sessions", max_sessions, 1, ""),
                ("min_sessions", min_sessions, 0, ""),
            )
            if value is not None
        }
        return cls(
            sessions="auto" if auto else counts.get("sessions"),
            min_sessions=counts.get("min_sessions"),
            max_sessions=counts.get("max_sessions"),
            batching=(
                batching if batching is BatchingDefault.BY_PROVIDER else Batching.parse(batching)
            ),
            per_session_state=per_session_state,
            create_in_background=create_in_background,
            serialize_creation=serialize_creation,
            providers=ProviderSettings(
                providers, provider_options, ep_libraries, ep_devices, serialize_runs
            ),
            session=SessionSettings(sess_options, configure, counts.get("cores")),
            weights=WeightsSettings.parse(
                mechanism=mechanism,
                prepacking=prepacking,
                weights=weights,
                verify_weights=verify_weights,
                size_threshold_bytes=size_threshold_bytes,
                cache_dir=cache_dir,
            ),
        )


@dataclasses.dataclass(frozen=True)
class PoolPlan:
    """What a pool will be, decided from its options before its model is read.

    Attributes:
        route: What the planner routes the model with (``route.plan``: the providers;
            ``route.max_sessions``: the most sessions, calibration's most with
            ``sessions="auto"``; on the CPU, ``route.session.configure`` turns memory
            patterns off first).
        runs: Whether runs are serialized on the device, and which rule said so.
        min_sessions: Sessions created up front (calibration may change both counts).
        default_sessions: The provider table's count, where nothing else says.
        batching_split: ``(sessions, intra-op threads)`` the pool takes instead where its
            requests merge, on the CPU, when neither a count nor threads were given
            (:func:`batching_split`); None: the count stands whatever batching decides.
        one_session: The pool holds one session by default (runs serialized, or each
            session holds its own copy of the weights): batching is ``"auto"`` by default.
        batching: The settings asked for; None: none asked for.
        auto_batching: Merge where the analysis proves the model batchable, else say why not.
        batching_by_default: ``batching`` was left out.
        calibrate: ``sessions="auto"``: measure the split before any session exists.
        cuda_graphs: Sessions capture CUDA graphs.
        warn_sessions: Warn that extra sessions run no more at once (runs serialized).
        serialize_creation: Create one session at a time, process-wide.
        create_in_background: Return once the first session exists.
    """

    route: RouteOptions
    runs: RunsRule
    min_sessions: int
    default_sessions: int
    batching_split: tuple[int, int] | None
    one_session: bool
    batching: Batching | None
    auto_batching: bool
    batching_by_default: bool
    calibrate: bool
    cuda_graphs: bool
    warn_sessions: bool
    serialize_creation: bool
    create_in_background: bool

    @property
    def providers(self) -> ProviderPlan:
        """The providers every session is created with."""
        return self.route.plan


def batching_split(cores: int) -> tuple[int, int]:
    """``(sessions, intra-op threads)`` of a merging CPU pool on ``cores`` by default.

    Sessions of at least :data:`BATCHING_THREADS` threads (one session of every core below
    twice that), at most :data:`DEFAULT_SESSIONS` of them: a lone request runs on every core
    one session may use, and waiting requests merge into that session's batch instead of
    splitting the cores into small sessions.
    """
    sessions = max(1, min(DEFAULT_SESSIONS, cores // BATCHING_THREADS))
    return sessions, max(1, cores // sessions)


def plan_pool(
    options: PoolOptions, providers: ProviderPlan, *, cores: int, ort_version: str | None = None
) -> PoolPlan:
    """The pool ``options`` ask for on ``providers``: a pure function of its arguments.

    Args:
        options: The pool's arguments, checked.
        providers: ``options.providers.plan()``.
        cores: The usable cores (``options.session.cores``, else this process's).
        ort_version: The installed onnxruntime's version (default: asked from onnxruntime),
            for the rule on runs (:func:`~sharedml.runtime._providers.runs_rule`).

    Raises:
        ValueError: arguments that cannot work together on these providers.
    """
    asked = options.providers.serialize_runs
    runs = runs_rule(providers, ort_version, asked=asked)
    serialized = runs.serialized
    if not options.serialize_creation and DML in providers.providers:
        raise ValueError(
            "serialize_creation=False with DmlExecutionProvider: creating DirectML sessions "
            "concurrently crashes some onnxruntime-directml versions; leave it True."
        )
    # The table's default, unless the caller overrode its rule on runs (then as it says).
    one = providers.facts.default_sessions == 1 if asked is None else serialized
    default = _SERIALIZED_SESSIONS if one else DEFAULT_SESSIONS
    count = options.sessions if isinstance(options.sessions, int) else None
    most = options.max_sessions or count or default
    if options.auto_sessions and providers.primary == CPU and not serialized:
        # Routed for the most sessions calibration may choose (map budget); the count and
        # the threads are set once it has measured.
        most = max(default, cores)
    least = options.min_sessions if options.min_sessions is not None else most
    if least > most:
        raise ValueError(f"min_sessions ({least}) is more than max_sessions ({most}).")
    by_default = options.batching is BatchingDefault.BY_PROVIDER
    setting = ("auto" if one else None) if by_default else options.batching
    session = options.session
    threads_given = bool(getattr(session.sess_options, "intra_op_num_threads", 0))
    counted = threads_given or any(
        n is not None for n in (options.sessions, options.min_sessions, options.max_sessions)
    )
    split = None
    if providers.primary == CPU and not serialized and not counted:
        split = batching_split(cores)
    if providers.primary == CPU:  # each session would keep its activations twice over
        session = dataclasses.replace(session, configure=without_memory_patterns(session.configure))
    return PoolPlan(
        route=RouteOptions(providers, most, session, options.weights),
        runs=runs,
        min_sessions=least,
        default_sessions=default,
        batching_split=split,
        one_session=one,
        batching=setting if isinstance(setting, Batching) else None,
        auto_batching=setting == "auto" or (isinstance(setting, Batching) and not setting.required),
        batching_by_default=by_default,
        calibrate=options.auto_sessions,
        cuda_graphs=cuda_graphs_enabled(providers.primary, providers.provider_options[0]),
        warn_sessions=serialized and most > 1 and not options.per_session_state,
        serialize_creation=options.serialize_creation,
        create_in_background=options.create_in_background,
    )

"""Strategies: the ways of giving N threads sessions over a model that ``inspect`` measures.

A strategy names its factory as ``"module:function"`` because the factory runs in the measuring
child process (:mod:`sharedml.inspection._child`), which imports it; the factory takes a
:class:`StrategyContext` and returns a :class:`SessionSet`. The registry is pluggable
(:func:`register_strategy`); everything that lists strategies (inspect, its recommendation, the
CLI's help, the benchmarks) reads it from here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from sharedml.runtime._providers import ProviderPlan

__all__ = [
    "NAIVE",
    "SHARED",
    "SHARED_PRIVATE_PACKS",
    "SHARED_RAW",
    "SINGLE",
    "Runner",
    "SessionSet",
    "Strategy",
    "StrategyContext",
    "get_strategy",
    "register_strategy",
    "registered_strategies",
]

_MODULE = "sharedml.inspection._strategies"

# The built-in strategies' names: what the recommendation compares, by name from here.
NAIVE = "naive"
SHARED = "shared"
SHARED_RAW = "shared-raw"
SHARED_PRIVATE_PACKS = "shared-private-packs"
SINGLE = "single"

Runner = Callable[[Mapping[str, Any]], object]
"""Runs one session once on the given feeds (a callable made by :meth:`SessionSet.add`)."""


@dataclasses.dataclass(frozen=True)
class StrategyContext:
    """What a strategy's factory gets, in the measuring child.

    Attributes:
        model_path: The user's model, as given.
        sessions: How many sessions the child will ask for.
        providers: Provider names in priority order (CPU last), as planned by sharedml.
        provider_options: One options dict per provider.
        plan: The provider plan itself, made in this child (a plugin EP's library registered
            and its device chosen, as in the parent); None: plain ``providers`` and
            ``provider_options``.
    """

    model_path: Path
    sessions: int
    providers: tuple[str, ...]
    provider_options: tuple[dict[str, str], ...]
    plan: ProviderPlan | None = None

    def plain_session(self, model: str | Path | bytes | None = None) -> Any:
        """A plain ``onnxruntime.InferenceSession`` on the planned providers (ORT's defaults).

        A plugin EP is chosen by device, as ORT's documentation does it; a session that fell
        back to the CPU raises ``ProviderError``.
        """
        import onnxruntime as ort

        source: str | bytes = model if isinstance(model, bytes) else str(model or self.model_path)
        if self.plan is None:
            return ort.InferenceSession(
                source,
                providers=list(self.providers),
                provider_options=[dict(o) for o in self.provider_options],
            )
        so = ort.SessionOptions()
        sess = ort.InferenceSession(source, so, **self.plan.session_kwargs(so))
        self.plan.check_session(sess, f"A plain session of '{self.model_path}'")
        return sess

    def pool_arguments(self) -> dict[str, Any]:
        """The provider arguments of a ``SessionPool`` on the planned providers."""
        if self.plan is None:
            return {
                "providers": list(self.providers),
                "provider_options": [dict(o) for o in self.provider_options],
            }
        return self.plan.to_spec()


class SessionSet(Protocol):
    """The sessions of one strategy, created one at a time by the measuring child.

    A set may also have a ``details()`` method returning a JSON-ready mapping of facts worth
    reporting (the pool's strategies give its mechanism and the reason); the child records it
    in :attr:`Measurement.details`.
    """

    def add(self) -> Runner:
        """Create one more session (or reuse one) and return a callable that runs it once."""

    def close(self) -> None:
        """Release every session."""


@dataclasses.dataclass(frozen=True)
class Strategy:
    """One way of giving N threads sessions over a model.

    Attributes:
        name: Short name, as in ``strategies.<name>`` of the JSON report.
        summary: One line for tables: what the N sessions are.
        factory: ``"module:function"``, importable in a fresh process; the function takes a
            :class:`StrategyContext` and returns a :class:`SessionSet`.
        warm_cache: The strategy uses sharedml's prepared-model cache: the parent prepares the
            model first, so that the one-time prepare is not counted as the sessions' memory.
        default: Measured by ``inspect`` when no strategies are named.
        weights: The weights format the strategy's pool asks for (``"float"``, ``"int8"``,
            ``"int4"``: :class:`~sharedml.prepared._compress.WeightsFormat`); the parent builds
            a compressed cache entry first, as it prepares for ``warm_cache``.
    """

    name: str
    summary: str
    factory: str
    warm_cache: bool = False
    default: bool = True
    weights: str = "float"


_REGISTRY: dict[str, Strategy] = {}
_REGISTRY_LOCK = threading.Lock()


def register_strategy(strategy: Strategy, *, replace: bool = False) -> None:
    """Add a strategy to the registry that ``inspect`` and :func:`measure` draw on.

    Args:
        strategy: The strategy. Its factory is only imported in the measuring child.
        replace: Replace a registered strategy of the same name instead of refusing.

    Raises:
        ValueError: the name is taken (and ``replace`` is false) or the factory is not of the
            form ``"module:function"``.

    Thread safety: safe to call from any thread.
    """
    module, _, func = strategy.factory.partition(":")
    if not module or not func:
        raise ValueError(
            f"Strategy {strategy.name!r}: factory must be 'module:function', not "
            f"{strategy.factory!r}."
        )
    with _REGISTRY_LOCK:
        if strategy.name in _REGISTRY and not replace:
            raise ValueError(f"A strategy named {strategy.name!r} is already registered.")
        _REGISTRY[strategy.name] = strategy


def registered_strategies() -> tuple[Strategy, ...]:
    """Every registered strategy, in registration order."""
    with _REGISTRY_LOCK:
        return tuple(_REGISTRY.values())


def get_strategy(name: str) -> Strategy:
    """The registered strategy called ``name``.

    Raises:
        ValueError: no such strategy (the message lists the known ones).
    """
    with _REGISTRY_LOCK:
        strategy = _REGISTRY.get(name)
        known = ", ".join(_REGISTRY)
    if strategy is None:
        raise ValueError(f"Unknown strategy {name!r}; known strategies: {known}.")
    return strategy


class _PlainSessions:
    """Plain ``InferenceSession``s over the user's model, ONNX Runtime defaults."""

    def __init__(self, ctx: StrategyContext, *, share_one: bool) -> None:
        self._ctx = ctx
        self._share_one = share_one
        self._sessions: list[Any] = []

    def add(self) -> Runner:
        if not self._sessions or not self._share_one:
            self._sessions.append(self._ctx.plain_session())
        sess = self._sessions[-1]
        return lambda feeds: sess.run(None, dict(feeds))

    def close(self) -> None:
        self._sessions.clear()


class _PoolSessions:
    """A :class:`sharedml.SessionPool` grown one session at a time by holding checkouts."""

    def __init__(self, ctx: StrategyContext, *, prepacking: str, weights: str = "float") -> None:
        from sharedml.pool._pool import SessionPool

        self._stack = contextlib.ExitStack()
        # min_sessions=0: the pool creates a session whenever all existing ones are checked
        # out, so holding k checkouts gives exactly k sessions. serialize_runs=False because a
        # serialized pool holds its run lock for a whole checkout; the child itself runs the
        # sessions one at a time where the provider needs that (see _child_measure).
        self._pool = SessionPool(
            ctx.model_path,
            sessions=ctx.sessions,
            min_sessions=0,
            **ctx.pool_arguments(),
            prepacking=prepacking,
            serialize_runs=False,
            weights=weights,
        )

    def add(self) -> Runner:
        sess = self._stack.enter_context(self._pool.session())
        return lambda feeds: sess.run(None, dict(feeds))

    def details(self) -> dict[str, Any]:
        stats = self._pool.recipe.runtime_stats
        return {
            "mechanism": str(self._pool.mechanism),
            "mechanism_reason": self._pool.mechanism_reason,
            # What ORT's optimized form of the model holds (derived and packed weights).
            "runtime_weights": dataclasses.asdict(stats) if stats is not None else None,
        }

    def close(self) -> None:
        self._stack.close()
        self._pool.close()


def _naive(ctx: StrategyContext) -> SessionSet:
    return _PlainSessions(ctx, share_one=False)


def _single(ctx: StrategyContext) -> SessionSet:
    return _PlainSessions(ctx, share_one=True)


def _shared(ctx: StrategyContext) -> SessionSet:
    return _PoolSessions(ctx, prepacking="auto")


def _shared_raw(ctx: StrategyContext) -> SessionSet:
    return _PoolSessions(ctx, prepacking="off")


def _shared_private_packs(ctx: StrategyContext) -> SessionSet:
    return _PoolSessions(ctx, prepacking="per-session")


def _shared_int8(ctx: StrategyContext) -> SessionSet:
    return _PoolSessions(ctx, prepacking="auto", weights="int8")


def _shared_int4(ctx: StrategyContext) -> SessionSet:
    return _PoolSessions(ctx, prepacking="auto", weights="int4")


for _strategy in (
    Strategy(NAIVE, "N plain onnxruntime.InferenceSession, ORT defaults", f"{_MODULE}:_naive"),
    Strategy(
        SHARED,
        "sharedml.SessionPool(model, sessions=N): defaults (packed weights shared too)",
        f"{_MODULE}:_shared",
        warm_cache=True,
    ),
    Strategy(
        SHARED_RAW,
        "SessionPool(..., prepacking='off'): raw weights shared, no packed kernels",
        f"{_MODULE}:_shared_raw",
        warm_cache=True,
    ),
    Strategy(
        SHARED_PRIVATE_PACKS,
        "SessionPool(..., prepacking='per-session'): each session packs its own copy",
        f"{_MODULE}:_shared_private_packs",
        warm_cache=True,
    ),
    Strategy(SINGLE, "one plain session shared by all N threads", f"{_MODULE}:_single"),
    # Compressed weights (docs/compress.md): measured when asked for (inspect --compress).
    *(
        Strategy(
            f"{SHARED}-{bits}",
            f"SessionPool(..., weights='{bits}'): MatMul/Gemm weights in {bits} blocks",
            f"{_MODULE}:_shared_{bits}",
            warm_cache=True,
            default=False,
            weights=bits,
        )
        for bits in ("int8", "int4")
    ),
):
    register_strategy(_strategy)
del _strategy

"""A pool's arguments, checked once and grouped, and the plan they make: no model, no session.

:func:`~sharedml.pool._options.plan_pool` is a pure function of the options, the provider plan
and the cores, so every decision it makes is asserted here without preparing or running
anything. DirectML plans are made with ``available=`` (planning creates no DML session).
"""

from __future__ import annotations

import dataclasses
import types
from pathlib import Path

import onnxruntime as ort
import pytest

import sharedml
from sharedml.pool._options import (
    BATCHING_THREADS,
    DEFAULT_SESSIONS,
    PoolOptions,
    PoolPlan,
    batching_split,
    plan_pool,
)
from sharedml.route import Mechanism, Prepacking
from sharedml.runtime._providers import ProviderPlan, ProviderSettings

CPU = "CPUExecutionProvider"
DML = "DmlExecutionProvider"
ORT = "1.22.0"  # a version on which DirectML's runs are serialized


def providers(name: str = CPU) -> ProviderPlan:
    return ProviderSettings([name]).plan(available=[DML, CPU])


def plan(provider: str = CPU, *, cores: int = 8, **arguments: object) -> PoolPlan:
    options = PoolOptions.from_arguments(**arguments)  # type: ignore[arg-type]
    return plan_pool(options, providers(provider), cores=cores, ort_version=ORT)


def test_the_arguments_travel_in_their_groups(tmp_path: Path) -> None:
    def configure(so: object) -> None:
        pass

    options = PoolOptions.from_arguments(
        sessions=3,
        providers=[CPU],
        provider_options=[{}],
        serialize_runs=False,
        ep_libraries={"FooExecutionProvider": "/opt/foo.so"},
        sess_options="template",
        configure=configure,
        cores=2,
        mechanism="ort-mmap",
        prepacking="off",
        weights="int8",
        verify_weights=False,
        size_threshold_bytes=4096,
        cache_dir=tmp_path,
        batching=True,
    )
    assert options.sessions == 3 and options.batching == sharedml.Batching()
    assert options.providers == ProviderSettings(
        [CPU], [{}], {"FooExecutionProvider": "/opt/foo.so"}, None, False
    )
    assert (options.session.sess_options, options.session.configure) == ("template", configure)
    assert options.session.cores == 2
    weights = options.weights
    assert (weights.mechanism, weights.prepacking) == (Mechanism.ORT_MMAP, Prepacking.OFF)
    assert weights.weights_format.value == "int8" and weights.verify_weights is False
    assert (weights.size_threshold_bytes, weights.cache_dir) == (4096, tmp_path)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.sessions = 4  # type: ignore[misc]


@pytest.mark.parametrize(
    ("arguments", "error", "message"),
    [
        ({"sessions": "auto", "max_sessions": 2}, ValueError, "'auto' chooses the number"),
        ({"sessions": 0}, ValueError, r"sessions must be an integer from 1 to \d+ or 'auto'"),
        ({"min_sessions": 1.5}, TypeError, "min_sessions must be an integer"),
        ({"cores": True}, ValueError, "cores must be an integer from 1"),
        ({"batching": "on"}, ValueError, "batching must be 'auto', True, False"),
        ({"mechanism": "telepathy"}, ValueError, "mechanism must be 'auto' or one of"),
        ({"prepacking": True}, ValueError, "prepacking=True is not a setting"),
        ({"prepacking": "shared", "mechanism": "ort-mmap"}, ValueError, "leave mechanism='auto'"),
        ({"weights": "int3"}, ValueError, "weights must be one of"),
        ({"size_threshold_bytes": -1}, ValueError, "whole number of bytes"),
    ],
)
def test_wrong_arguments_are_refused_when_the_options_are_built(
    arguments: dict[str, object], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        PoolOptions.from_arguments(**arguments)  # type: ignore[arg-type]


def test_a_cpu_pool_runs_side_by_side_and_merges_only_when_asked() -> None:
    planned = plan()
    assert planned.providers.primary == CPU and not planned.runs.serialized
    assert planned.route.max_sessions == planned.min_sessions == DEFAULT_SESSIONS
    assert planned.batching is None and not planned.auto_batching
    assert planned.batching_by_default and not planned.one_session
    assert not planned.warn_sessions and not planned.calibrate
    assert plan(batching="auto").auto_batching
    assert plan(batching=True).batching == sharedml.Batching()
    grown = plan(sessions=2, min_sessions=0, max_sessions=6)
    assert (grown.min_sessions, grown.route.max_sessions) == (0, 6)


@pytest.mark.parametrize("cores", [1, 2, 3, 4, 7, 8, 12, 16, 64])
def test_a_merging_cpu_pool_gives_every_session_several_cores(cores: int) -> None:
    sessions, threads = batching_split(cores)
    assert 1 <= sessions <= DEFAULT_SESSIONS and sessions * threads <= cores
    assert threads >= min(cores, BATCHING_THREADS)  # a lone request gets several cores
    assert sessions * threads > cores - sessions  # and the sessions leave none idle
    assert plan(cores=cores).batching_split == (sessions, threads)


@pytest.mark.parametrize(
    "arguments",
    [
        {"sessions": 4},
        {"min_sessions": 1},
        {"max_sessions": 2},
        {"sessions": "auto"},
    ],
)
def test_a_count_the_caller_gave_is_never_replaced(arguments: dict[str, object]) -> None:
    assert plan(batching=True, **arguments).batching_split is None


def test_threads_the_caller_gave_keep_the_count() -> None:
    template = ort.SessionOptions()
    template.intra_op_num_threads = 1
    assert plan(sess_options=template).batching_split is None
    assert plan(DML).batching_split is None  # one session already, runs serialized


def test_a_serialized_provider_gets_one_session_that_merges_by_default() -> None:
    planned = plan(DML)
    assert planned.runs.serialized and planned.one_session
    assert planned.route.max_sessions == planned.default_sessions == 1
    assert planned.auto_batching and planned.batching_by_default
    assert plan(DML, sessions=3).warn_sessions  # extra sessions run no more at once
    assert not plan(DML, sessions=3, per_session_state=True).warn_sessions
    assert not plan(DML, batching=False).auto_batching
    # The caller's word on runs overrides the table, and with it the default count.
    overlapping = plan(DML, serialize_runs=False)
    assert not overlapping.runs.serialized and overlapping.route.max_sessions == DEFAULT_SESSIONS


def test_auto_sessions_route_for_the_most_calibration_may_choose() -> None:
    planned = plan(sessions="auto", cores=12)
    assert planned.calibrate and planned.route.max_sessions == 12
    assert plan(sessions="auto", cores=2).route.max_sessions == DEFAULT_SESSIONS
    assert plan(DML, sessions="auto", cores=12).route.max_sessions == 1  # serialized: no split


def test_arguments_that_cannot_work_on_the_providers_are_refused() -> None:
    with pytest.raises(ValueError, match=r"min_sessions \(5\) is more than max_sessions \(4\)"):
        plan(min_sessions=5)
    with pytest.raises(ValueError, match="serialize_creation=False with DmlExecutionProvider"):
        plan(DML, serialize_creation=False)
    assert not plan(serialize_creation=False).serialize_creation


def test_the_route_gets_the_groups_cpu_sessions_with_memory_patterns_off_first() -> None:
    called: list[bool] = []

    def configure(so: object) -> None:
        called.append(so.enable_mem_pattern)  # type: ignore[attr-defined]

    options = PoolOptions.from_arguments(
        sessions=2, cores=3, prepacking="per-session", configure=configure, sess_options="t"
    )
    planned = plan_pool(options, providers(), cores=3, ort_version=ORT)
    assert planned.route.weights is options.weights and planned.route.plan == providers()
    session = planned.route.session
    assert (session.sess_options, session.cores) == ("t", 3)
    so = types.SimpleNamespace(enable_mem_pattern=True)
    assert session.configure is not None
    session.configure(so)
    assert called == [False]  # off before the caller's configure, which may turn them on
    assert plan_pool(options, providers(DML), cores=3, ort_version=ORT).route.session is (
        options.session
    )

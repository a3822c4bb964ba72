"""inspect's recommendation: every sentence follows from the figures beside it, one test a branch.

The figures are made up for the purpose (``fake_measurement``); the thresholds are relative
(``SAME_WITHIN``), so a small model's pool that is 46% smaller than plain sessions is "less",
not "saves little", and nothing is called the least memory or the fastest unless measured so.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from test_inspect import MiB, fake_measurement, fake_report

from sharedml.inspection._inspect import SAME_WITHIN, Finding, findings


def by_kind(found: tuple[Finding, ...]) -> dict[str, Finding]:
    return {f.kind: f for f in found}


def verdicts(sessions: int, weights_bytes: int, **named: Any) -> dict[str, Finding]:
    """The findings for ``named`` measurements (see :func:`measured`), by kind."""
    return by_kind(findings(measured(**named), sessions=sessions, weights_bytes=weights_bytes))


def measured(**named: tuple[float, float] | tuple[float, float, dict[str, Any]]) -> dict[str, Any]:
    out = {}
    for name, spec in named.items():
        per, base, *rest = spec
        kw = rest[0] if rest else {}
        out[name.replace("_", "-")] = fake_measurement(name.replace("_", "-"), per, base, **kw)
    return out


def test_same_within_is_relative() -> None:
    assert 0 < SAME_WITHIN < 0.5


def test_a_pool_46_percent_smaller_is_less_however_small_the_model() -> None:
    # 4 plain sessions: 4 x 1.3 = 5.2 MiB; the pool 2.8 MiB: under the old absolute 8 MiB band.
    found = verdicts(4, MiB, naive=(1.3, 0), shared=(0.2, 2.0))
    text = found["pool-vs-plain"].text
    assert "2.4 MiB (46%) less" in text and "saves" not in text
    assert found["pool-vs-plain"].figures["verdict"] == "less"
    assert "Use sharedml.SessionPool(model, sessions=4)" in found["advice"].text


def test_a_pool_larger_than_plain_sessions_says_so_and_is_not_recommended() -> None:
    found = verdicts(4, MiB, naive=(5, 0), shared=(5, 4))
    assert "takes 24.0 MiB (PSS): more than 4 plain sessions" in found["pool-vs-plain"].text
    assert "20% more than their 20.0 MiB" in found["pool-vs-plain"].text
    assert "sharing does not pay" in found["advice"].text
    assert "SessionPool(model" not in found["advice"].text


def test_within_ten_percent_is_about_the_same() -> None:
    found = verdicts(4, MiB, naive=(5, 0), shared=(4.5, 1))
    assert "within 10% of each other" in found["pool-vs-plain"].text
    assert found["pool-vs-plain"].figures["verdict"] == "same"


def test_one_plain_session_smaller_than_the_pool_is_the_advice_not_the_pool() -> None:
    # single 40% smaller than the pool: SessionPool was once recommended anyway.
    found = verdicts(4, 100 * MiB, naive=(100, 0), shared=(10, 60), single=(0, 60))
    assert "60.0 MiB, 40% less than the pool's 100.0 MiB" in found["single-vs-pool"].text
    assert found["advice"].figures["least"] == "single"
    assert found["advice"].text.startswith("Use one plain session shared by the threads")
    assert "it took the least memory" in found["advice"].text
    assert "sharedml.SessionPool(model, sessions=4) where each thread needs" in found["advice"].text


def test_one_plain_session_about_as_large_as_the_pool_is_about_as_much() -> None:
    found = verdicts(4, 100 * MiB, naive=(100, 0), shared=(1, 100), single=(0, 100))
    assert "about as much as the pool's 104.0 MiB (within 10%)" in found["single-vs-pool"].text
    assert found["advice"].figures["least"] == "single"
    advice = found["advice"].text
    assert advice.startswith("Use sharedml.SessionPool(model, sessions=4)")  # a tie: the rule
    assert "about as little as the least measured" in advice and "the least memory" not in advice
    assert "(one plain session shared by the threads: 100.0 MiB, within 10%)" in advice


def advice_for(shared: float, single: float | None, naive: float) -> tuple[Finding, dict[str, int]]:
    """The advice of 4 sessions whose totals are these MiB (flat: no per-session growth)."""
    named: dict[str, tuple[float, float]] = {"naive": (0, naive), "shared": (0, shared)}
    if single is not None:
        named["single"] = (0, single)
    found = verdicts(4, 10 * MiB, **named)
    known = {name.replace("_", "-"): int(base * MiB) for name, (_per, base) in named.items()}
    return found["advice"], known


def test_the_demo_figures_of_a_pool_about_as_large_as_one_session_are_about_as_little() -> None:
    """The demo: shared 50.6 MiB, single 49.2; the advice said the pool took "the least"."""
    advice, _known = advice_for(50.6, 49.2, 194)
    assert "the least memory" not in advice.text
    assert "50.6 MiB, about as little as the least measured" in advice.text
    assert "49.2 MiB, within 10%" in advice.text
    assert advice.figures["least"] == "single" and advice.figures["chosen"] == "shared"


_MIB_FIGURE = re.compile(r"(\d+\.\d) MiB")
_USE = {
    "shared": "Use sharedml.SessionPool(model, sessions=4)",
    "single": "Use one plain session shared by the threads",
    "naive": "Use 4 plain sessions",
}


@pytest.mark.parametrize("shared", [40.0, 47.0, 49.2, 50.6, 54.0, 60.0, 100.0])
@pytest.mark.parametrize("single", [None, 30.0, 49.2, 52.0, 80.0])
@pytest.mark.parametrize("naive", [20.0, 45.0, 55.0, 194.0])
def test_advice_sentences_hold_against_their_figures(
    shared: float, single: float | None, naive: float
) -> None:
    """Whatever the figures: "the least" names the minimum; "about as little" one within 10%.

    Every MiB figure in the sentence is one of the totals compared, and the strategy
    recommended is the rule's (README): the least, or the first of pool, one session, plain
    sessions within 10% of it.
    """
    advice, known = advice_for(shared, single, naive)
    text, least = advice.text, min(known.values())
    chosen = [name for name, start in _USE.items() if text.startswith(start)]
    assert len(chosen) == 1, text
    mine = known[chosen[0]]
    quoted = {float(f) for f in _MIB_FIGURE.findall(text)}
    assert quoted <= {round(v / MiB, 1) for v in known.values()}, (text, known)
    if "the least memory" in text:
        assert mine == least and "about as little" not in text
    else:
        assert "about as little as the least measured" in text
        assert least < mine <= (1 + SAME_WITHIN) * least
    order = [n for n in ("shared", "single", "naive") if n in known]
    assert chosen[0] == next(n for n in order if known[n] - least <= SAME_WITHIN * least)


def test_prepacking_off_is_never_called_least_memory_or_fastest_unless_measured_so() -> None:
    # An int8 MiniLM's shape: off took 7x the memory and 4x the time of the default.
    slow = {"setup_seconds": 1.3}
    found = verdicts(4, 22 * MiB, naive=(90, 0), shared=(1, 50), shared_raw=(86, 35, slow))
    text = found["prepacking-off"].text
    assert "took 379.0 MiB, 7.0x the default's 54.0 MiB" in text
    assert "(slower)" in text and "least memory" not in text and "fastest" not in text
    assert found["prepacking-off"].figures["memory"] == "more"
    found = verdicts(
        4, 22 * MiB, naive=(90, 0), shared=(1, 80, {"setup_seconds": 1.0}), shared_raw=(1, 40)
    )
    assert "took 44.0 MiB, 48% less than the default's 84.0 MiB" in found["prepacking-off"].text
    assert "(faster)" in found["prepacking-off"].text


def test_per_session_packing_is_compared_relative_to_a_plain_session() -> None:
    found = verdicts(4, 100 * MiB, naive=(100, 0), shared=(1, 100), shared_private_packs=(60, 100))
    assert "adds 59.0 MiB more per session than the default" in found["per-session-packing"].text
    assert found["per-session-packing"].text.endswith("(340.0 MiB in all at 4).")  # cause unknown
    derived = {"details": {"runtime_weights": {"derived_bytes": 4 * MiB, "prepacked_bytes": 0}}}
    found = verdicts(
        2, 4 * MiB, naive=(8, 0), shared=(3, 10, derived), shared_private_packs=(7.6, 10)
    )
    assert "ORT packs nothing here, but each session derives its own copy of the 4.0 MiB" in (
        found["per-session-packing"].text
    )
    found = verdicts(4, 100 * MiB, naive=(100, 0), shared=(1, 100), shared_private_packs=(2, 100))
    assert "costs about as much per session as the default" in found["per-session-packing"].text


def test_runtime_weights_say_what_plain_sessions_hold_beyond_the_file() -> None:
    stats = {
        "details": {"runtime_weights": {"derived_bytes": 86 * MiB, "prepacked_bytes": 40 * MiB}}
    }
    found = verdicts(4, 22 * MiB, naive=(93, 0), shared=(1, 50, stats))
    text = found["runtime-weights"].text
    assert (
        "Each plain session holds 93.0 MiB more than the one before, 4.2x the file's 22.0 MiB"
        in text
    )
    assert "ORT derives 86.0 MiB of weights from them" in text and "packs 40.0 MiB" in text
    plain = verdicts(4, 22 * MiB, naive=(23, 0), shared=(1, 20, stats))
    assert "runtime-weights" not in plain  # a plain session holding about the file says nothing
    # A tiny model whose sessions grow by more than its weights, but ORT derives nothing: the
    # growth is the session's own (logreg_iris: 220 KiB a session for 108 B of weights).
    nothing = {"details": {"runtime_weights": {"derived_bytes": 0, "prepacked_bytes": 0}}}
    tiny = findings(
        measured(naive=(0.2, 0), shared=(0.1, 6, nothing)), sessions=2, weights_bytes=108
    )
    assert "runtime-weights" not in by_kind(tiny)
    unknown = findings(measured(naive=(93, 0), shared=(1, 50)), sessions=4, weights_bytes=22 * MiB)
    assert "runtime-weights" not in by_kind(unknown)  # no saved-model figures: no claim


def test_derived_weights_on_the_raw_route_are_said_to_be_per_session() -> None:
    stats = {"details": {"runtime_weights": {"derived_bytes": 11 * MiB, "prepacked_bytes": 0}}}
    found = verdicts(4, 11 * MiB, naive=(20, 0), shared=(1, 12), shared_raw=(12, 0, stats))
    assert (
        "prepacking='off' (shared-raw) shares only the file's weights"
        in found["derived-not-shared"].text
    )
    assert "11.0 MiB of weights" in found["derived-not-shared"].text


def test_weights_in_node_attributes_are_said_not_to_be_shared() -> None:
    found = by_kind(
        findings(
            measured(naive=(1, 0), shared=(1, 0)),
            sessions=4,
            weights_bytes=MiB,
            unshared=(3, MiB),
        )
    )
    assert found["unshared-weights"].text.startswith("1.0 MiB of weights in 3 node attributes")
    assert "every session keeps its own copy" in found["unshared-weights"].text


def test_numerics_name_the_strategies_whose_outputs_differ_from_a_plain_session() -> None:
    differs = {"plain_max_abs_diff": 0.42, "plain_outputs_compared": 2}
    equal = {"plain_max_abs_diff": 0.0, "plain_outputs_compared": 2}
    found = verdicts(2, 10 * MiB, naive=(10, 0, equal), shared=(1, 10, differs))
    text = found["numerics"].text
    assert "shared by up to 0.42" in text and "naive" not in text.split(":")[1].split(".")[0]
    assert "each CPU session cores // 2 intra-op threads" in text
    assert "unpacked kernels" not in text  # shared-raw was not among those that differ
    assert found["numerics"].figures["shared"]["max_abs_diff"] == 0.42
    found = verdicts(2, 10 * MiB, naive=(10, 0, equal), shared=(1, 10, equal))
    assert (
        found["numerics"].text
        == "Every strategy's outputs were bitwise equal to a default plain session's."
    )


def test_one_session_says_there_is_nothing_to_share() -> None:
    found = findings(
        {
            "naive": fake_measurement("naive", 100, 0, n=1),
            "shared": fake_measurement("shared", 1, 100, n=1),
        },
        sessions=1,
        weights_bytes=100 * MiB,
    )
    assert [f.kind for f in found] == ["one-session"]


def test_the_json_carries_the_findings_structured_beside_the_prose() -> None:
    report = fake_report([fake_measurement("naive", 100, 0), fake_measurement("shared", 1, 100)])
    report = type(report)(
        **{
            **report.__dict__,
            "findings": findings(report.strategies, sessions=4, weights_bytes=100 * MiB),
        }
    )
    d = report.to_dict()
    assert [f["kind"] for f in d["findings"]] == ["pool-vs-plain", "advice"]
    assert d["findings"][0]["figures"]["pool_bytes"] == 104 * MiB
    assert d["findings"][0]["figures"]["plain_bytes"] == 400 * MiB
    assert all(set(f) == {"kind", "text", "figures"} for f in d["findings"])


def served(held_mib: float, trimmed_mib: float) -> dict[str, Any]:
    """A serving process's figures (``Measurement.held_growth``/``trimmed_growth``), MiB."""
    return {
        "held_growth": {"pss": int(held_mib * MiB)},
        "trimmed_growth": {"pss": int(trimmed_mib * MiB)},
        "served_rounds": 3,
    }


def test_the_advice_uses_what_a_server_holds_and_says_where_trimmed_figures_differ() -> None:
    # Plain sessions keep their load-time heap untrimmed: 640 held, 384 trimmed; one shared
    # session 160 held, 96 trimmed; the pool trims as it creates sessions: 100 either way.
    found = verdicts(
        4,
        100 * MiB,
        naive=(96, 0, served(640, 384)),
        shared=(0.5, 98, served(100, 100)),
        single=(0, 96, served(160, 96)),
    )
    assert found["pool-vs-plain"].figures["plain_bytes"] == 640 * MiB
    assert found["advice"].figures["least"] == "shared"
    held = found["held-vs-trimmed"]
    assert held.figures["trimmed"] == {"shared": 100 * MiB, "single": 96 * MiB, "naive": 384 * MiB}
    assert held.figures["kept_bytes"]["naive"] == 256 * MiB
    assert "4 plain sessions: 640.0 MiB held, 384.0 MiB trimmed" in held.text
    # Trimmed, one shared session is within 10% of the pool: the rule still names the pool.
    assert held.figures["trimmed_choice"] == "shared" and "instead" not in held.text


def test_held_vs_trimmed_names_the_strategy_the_trimmed_figures_would_have_chosen() -> None:
    found = verdicts(
        4,
        10 * MiB,
        naive=(10, 0, served(40, 40)),
        shared=(0.5, 30, served(32, 32)),
        single=(0, 30, served(48, 20)),
    )
    assert found["advice"].figures["chosen"] == "shared"
    held = found["held-vs-trimmed"]
    assert held.figures["trimmed_choice"] == "single"
    assert "Trimmed, the advice would name one plain session shared by the threads" in held.text


def test_without_a_serving_process_there_is_no_held_vs_trimmed_finding() -> None:
    found = verdicts(4, MiB, naive=(5, 0), shared=(0.2, 2.0))
    assert "held-vs-trimmed" not in found


def test_totals_that_shrank_below_zero_still_give_advice() -> None:
    # A total is growth over the baseline: a reading that shrank (the heap given back, another
    # process's pages gone) can make it negative, and a value is still the same as itself.
    found = verdicts(4, MiB, naive=(-0.5, 0), shared=(-0.1, -1), single=(0, -2))
    assert found["advice"].figures["least"] in ("naive", "shared", "single")
    assert found["pool-vs-plain"].figures["verdict"] in ("less", "same", "more")

"""``sharedml inspect``'s output, byte for byte, for reports made up here (nothing is measured).

Each scenario builds the report objects directly (measurements, weights, tables, the trial
run, sharedml's own cost, a compressed model's accuracy), adds the findings with
:func:`sharedml.inspect`'s own last step, and runs the CLI on it (``inspect`` itself replaced
by one that returns the report): the text it prints to a pipe and to a cp1252 pipe, its
``--json`` and the rich rendering at a narrow and a wide console must equal the files under
``golden/``. Together the scenarios reach every
section of the text report and every finding, so a rendering or a finding that changes shows
here as a diff.

A deliberate change of the output: regenerate with ``SHAREDML_UPDATE_GOLDEN=1 pytest
tests/inspection/test_inspect_output.py`` and review the diff of ``golden/`` before committing.
"""

from __future__ import annotations

import io
import json
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest

import sharedml.inspection._inspect as inspect_module
from sharedml._errors import MeasurementError
from sharedml.cli import main
from sharedml.cli._inspect import render_text
from sharedml.inspection._compressed import CompressedAccuracy, OutputAccuracy
from sharedml.inspection._inspect import (
    InspectReport,
    PlacementSummary,
    SerializedRuns,
    TensorInfo,
    WeightsSummary,
)
from sharedml.inspection._measure import FixedCost
from sharedml.inspection._results import Measurement, MemoryPoint
from sharedml.model._inputs import ChosenSize, InputSpec
from sharedml.model._tables import IndexedTable

GOLDEN = Path(__file__).parent / "golden"
UPDATE = os.environ.get("SHAREDML_UPDATE_GOLDEN") == "1"
MiB = 2**20
KiB = 2**10


def matches_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if UPDATE:
        GOLDEN.mkdir(exist_ok=True)
        path.write_text(text, encoding="utf-8", newline="\n")
    expected = path.read_text(encoding="utf-8")
    assert text == expected, f"{name} changed (SHAREDML_UPDATE_GOLDEN=1 rewrites it)"


# --------------------------------------------------------------------------------------------
# Made-up figures


def point(k: int, mib: float, **kw: Any) -> MemoryPoint:
    """Memory after ``k`` sessions: ``mib`` of the headline metric, the others beside it."""
    b = int(mib * MiB) + 12_345 * k  # odd bytes: rounding shows
    figures: dict[str, Any] = {
        "sessions": k,
        "pss_bytes": b,
        "uss_bytes": b - 3 * MiB,
        "rss_bytes": b + 9 * MiB,
        "untrimmed_bytes": b + 20 * MiB,
        "device_bytes": None,
        "create_seconds": 0.125 * k,
        "run_seconds": 0.0125 * k,
    }
    return MemoryPoint(**(figures | kw))


def measured(
    name: str,
    per_mib: float,
    base_mib: float,
    *,
    sessions: int = 4,
    points: int | None = None,
    held: Mapping[str, float] | None = None,
    trimmed_mib: Mapping[str, float] | None = None,
    traffic_mib: float | None = None,
    point_kw: Mapping[str, Any] | None = None,
    **kw: Any,
) -> Measurement:
    """A measurement of ``sessions`` sessions growing by ``per_mib`` each over ``base_mib``."""
    count = sessions if points is None else points
    pts = tuple(point(k, base_mib + per_mib * k, **(point_kw or {})) for k in range(1, count + 1))
    traffic = ()
    if traffic_mib is not None:  # sessions 1..k having run over the tables' rows
        last = base_mib + per_mib * count
        traffic = tuple(point(k, last + traffic_mib * k) for k in range(1, count + 1))
    return Measurement(
        strategy=name,
        summary=f"{name}: made up for the golden output",
        sessions=sessions,
        metric=kw.pop("metric", "pss"),
        points=pts,
        baseline_bytes=kw.pop("baseline_bytes", 57 * MiB + 321),
        trimmed=kw.pop("trimmed", True),
        setup_seconds=kw.pop("setup_seconds", 0.25),
        concurrent=kw.pop("concurrent", True),
        onnxruntime_version="1.32.0",
        traffic_points=traffic,
        held_growth={k: int(v * MiB) for k, v in (held or {}).items()},
        trimmed_growth={k: int(v * MiB) for k, v in (trimmed_mib or {}).items()},
        served_rounds=3 if held else 0,
        **kw,
    )


def weights_summary(
    *, prepared: bool = False, mib: int = 100, unshared: bool = True
) -> WeightsSummary:
    placements = (
        PlacementSummary("initializers", 200, mib * MiB),
        PlacementSummary("Constant nodes", 12, 3 * KiB),
        PlacementSummary("node attributes", 3, 2 * MiB + 17),
        PlacementSummary("subgraphs", 4, MiB),
        PlacementSummary("external files", 2, 50 * MiB),
        PlacementSummary("sparse initializers", 1, 10 * KiB),
    )
    if not unshared:
        placements = tuple(p for p in placements if p.placement in ("initializers", "subgraphs"))
    largest = (
        TensorInfo("encoder.weight", "float", (5120, 2048), 40 * MiB, "initializers"),
        TensorInfo("head.weight", "float", (4096, 2560), 40 * MiB, "external files", "w.bin"),
        TensorInfo("decoder.bias", "float16", (1024, 1024), 2 * MiB, "initializers"),
        TensorInfo("tree.nodes_values", "float", (524288,), 2 * MiB, "node attributes"),
        TensorInfo("scale", "float", (), 4, "Constant nodes"),
    )
    return WeightsSummary(
        total_bytes=sum(p.nbytes for p in placements),
        tensors=sum(p.tensors for p in placements),
        placements=placements,
        external_files=(("extra.bin", 10 * MiB), ("w.bin", 40 * MiB)),
        largest=largest,
        already_prepared=prepared,
        prepare_moves_tensors=150,
        prepare_moves_bytes=151 * MiB,
        prepare_leaves_tensors=7,
        prepare_leaves_bytes=5 * KiB,
        prepare_converts_constants=2,
    )


def with_findings(report: InspectReport, serialized: SerializedRuns | None = None) -> InspectReport:
    """``report`` with the findings :func:`sharedml.inspect` computes from its figures."""
    return inspect_module._with_findings(report, serialized)


def report_of(**kw: Any) -> InspectReport:
    fields: dict[str, Any] = {
        "model_path": Path("model.onnx"),
        "demo": False,
        "sessions": 4,
        "providers": ("CPUExecutionProvider",),
        "device": "CPU",
        "inputs": (),
        "weights": weights_summary(),
        "measurements": (),
        "projection_sessions": (1, 2, 4, 8, 16, 32),
        "recommendation": "",
        "onnxruntime_version": "1.32.0",
        "platform": "Linux-made-up",
    }
    return InspectReport(**(fields | kw))


# --------------------------------------------------------------------------------------------
# The scenarios


def everything_on_the_cpu() -> InspectReport:
    """Four sessions of every strategy: tables read by traffic, numerics, compressed, stopped."""
    ids = InputSpec(
        "input_ids",
        "int64",
        (1, 128),
        ("batch", "seq"),
        chosen=(
            ChosenSize("input_ids", 0, "batch", 1, "batch", "a batch of 1"),
            ChosenSize("input_ids", 1, "seq", 128, "length", "a length of 128"),
        ),
    )
    mask = InputSpec("attention_mask", "bool", (1, 128), ("batch", "seq"))
    pixels = InputSpec(
        "pixels",
        "float32",
        (1, 3, 224, 224),
        ("batch", None, "h", "w"),
        chosen=(
            ChosenSize("pixels", 2, "h", 224, "image", "an image's height, at least 224"),
            ChosenSize("pixels", 3, "w", 224, "image", "an image's width, at least 224"),
        ),
    )
    stats = {"derived_bytes": 30 * MiB + 5, "prepacked_bytes": 20 * MiB + 7}
    traffic = {
        "runs": 24,
        "rows": {"word_embeddings": 30522, "position_embeddings": 512, "chars": 1000},
        "seconds": 3.25,
        "partial": False,
    }
    measurements = (
        measured(
            "naive",
            250,
            2,
            held={"pss": 1030, "uss": 1021, "rss": 1045},
            trimmed_mib={"pss": 1002.5, "uss": 999, "rss": 1011},
            traffic_mib=3,
            traffic=traffic,
            plain_max_abs_diff=0.0,
            plain_outputs_compared=2,
        ),
        measured(
            "shared",
            1,
            100,
            held={"pss": 130, "uss": 120, "rss": 160},
            trimmed_mib={"pss": 104.5, "uss": 101, "rss": 140},
            traffic_mib=0.5,
            traffic=traffic,
            point_kw={"rounds": 3},
            details={"mechanism": "prepacked-file", "runtime_weights": stats},
            plain_max_abs_diff=0.0,
            plain_outputs_compared=2,
        ),
        measured(
            "shared-raw",
            2,
            100,
            setup_seconds=0.75,
            point_kw={"rounds": 5, "settled": False},
            details={"mechanism": "prepacked-file", "runtime_weights": {"derived_bytes": 30 * MiB}},
            plain_max_abs_diff=2.4e-6,
            plain_outputs_compared=2,
        ),
        measured(
            "shared-private-packs",
            60,
            100,
            points=3,
            stopped_reason="memory ran low after 3 sessions",
            details={"mechanism": "in-memory-file", "runtime_weights": stats},
            plain_outputs_compared=2,
            plain_outputs_comparable=False,
        ),
        measured(
            "single",
            0,
            130,
            held={"pss": 150, "uss": 141, "rss": 170},
            trimmed_mib={"pss": 131, "uss": 128, "rss": 150},
            traffic_mib=0.25,
            traffic=traffic,
            plain_outputs_compared=2,
            plain_outputs_nonfinite=3,
        ),
        measured("shared-int8", 0.5, 40, details={"mechanism": "prepacked-file"}),
    )
    tables = (
        IndexedTable("word_embeddings", "float", (30522, 768), 30522 * 768 * 4, 30522, "Gather",
                     "input_ids"),
        IndexedTable("position_embeddings", "float", (512, 768), 512 * 768 * 4, 512, "Gather",
                     None),
        IndexedTable("chars", "float16", (1000, 64), 128_000, 1000, "Gather", "input_ids",
                     block=(1, 0)),
        IndexedTable("types", "float", (2, 768), 6144, 2, "Gather", "input_ids"),
    )  # fmt: skip
    trial = {
        "error": None,
        "outputs": [
            {"name": "logits", "dtype": "float32", "shape": [1, 10], "nonfinite": 3},
            {"name": "pooled", "dtype": "float32", "shape": [1, 8], "nonfinite": 0},
        ],
        "run_seconds": 0.0125,
        "device": "CPU",
        "rejected_sizes": [
            {
                "inputs": ["pixels float32[batch=1, 3, h=640, w=640]"],
                "error": "Got invalid dimensions for input: pixels.",
            }
        ],
    }
    shared_trimmed = int(104.5 * MiB)
    fixed = FixedCost(
        imports={"pss": 12 * MiB + 99, "uss": 11 * MiB, "rss": 20 * MiB, "private": None},
        pool={"pss": shared_trimmed + 18 * MiB, "uss": 119 * MiB, "rss": 170 * MiB},
    )
    compressed = CompressedAccuracy(
        "int8",
        Path("model.int8.onnx"),
        "shared-int8",
        outputs=(
            OutputAccuracy("out0", 0.0123, 0.0045, 0.98, 50),
            OutputAccuracy("out1", 1.5e-3, 2.1e-4, None, 0),
        ),
    )
    return with_findings(
        report_of(
            inputs=(ids, mask, pixels),
            measurements=measurements,
            trial=trial,
            fixed_cost=fixed,
            tables=tables,
            compressed=compressed,
        )
    )


def one_session_on_a_serializing_device() -> InspectReport:
    """DirectML: one session, runs one at a time, no trim, device memory, degenerate inputs."""
    image = InputSpec(
        "image",
        "float32",
        (1, 3, 1, 1),
        ("batch", None, "height", "width"),
        chosen=(
            ChosenSize("image", 2, "height", 1, "image", "a plain session refused larger"),
            ChosenSize("image", 3, "width", 1, "image", "a plain session refused larger"),
        ),
    )
    given = InputSpec("scale", "float32", (1,), (None,), source="file")
    note = "the private bytes: mapped files are not in it"
    device = "not measurable: DirectML reports no per-process device memory"
    common: dict[str, Any] = {
        "sessions": 1,
        "metric": "uss",
        "trimmed": False,
        "concurrent": False,
        "metric_note": note,
    }
    measurements = (
        measured("naive", 90, 1, device_note=device, **common),
        measured(
            "shared",
            80,
            3,
            device_metric="dxgi",
            point_kw={"device_bytes": 75 * MiB},
            traffic={"error": "ids out of range for table 'rows'"},
            **common,
        ),
        measured("single", 90, 1, **common),
    )
    trial = {
        "error": None,
        "outputs": [{"name": "y", "dtype": "float32", "shape": [1, 10], "nonfinite": 0}],
        "run_seconds": 0.5,
        "device": "AMD Radeon RX 7600 (DXGI adapter 0)",
        "rejected_sizes": [
            {"inputs": ["image float32[batch=1, 3, height=224, width=224]"], "error": "bad size."},
            {"inputs": ["image float32[batch=1, 3, height=32, width=32]"], "error": "too small"},
        ],
    }
    serialized = SerializedRuns(
        "DmlExecutionProvider",
        "1.22.0",
        None,
        "DirectML runs one Run at a time per process",
    )
    return with_findings(
        report_of(
            sessions=1,
            providers=("DmlExecutionProvider", "CPUExecutionProvider"),
            device=trial["device"],
            inputs=(image, given),
            measurements=measurements,
            trial=trial,
            fixed_cost=FixedCost({}, {}, error="the child exited with status 1"),
            tables=(IndexedTable("rows", "float", (64, 16), 4096, 64, "GatherND", None),),
        ),
        serialized=serialized,
    )


def plain_sessions_are_smaller() -> InspectReport:
    """Two sessions of a small model whose pool costs more; runs serialized, not batchable."""
    measurements = (
        measured("naive", 1, 0, sessions=2),
        measured("shared", 1.5, 2, sessions=2, setup_seconds=0.5),
        measured("shared-raw", 1, 1, sessions=2, setup_seconds=0.4),
        measured("shared-private-packs", 1.5, 2, sessions=2),
    )
    serialized = SerializedRuns(
        "WebGpuExecutionProvider", "1.23.0", "input 'x' is fixed at 1 on axis 0", ""
    )
    return with_findings(
        report_of(
            sessions=2,
            weights=weights_summary(mib=1),
            inputs=(InputSpec("x", "float32", (1, 8), (None, None)),),
            measurements=measurements,
            projection_sessions=(1, 2, 64),
        ),
        serialized=serialized,
    )


def nothing_to_compare() -> InspectReport:
    """The demo, prepared already, one strategy measured: no recommendation can be made."""
    return with_findings(
        report_of(
            demo=True,
            model_path=Path("demo.onnx"),
            sessions=2,
            weights=weights_summary(prepared=True, unshared=False),
            inputs=(InputSpec("x", "float32", (1, 1024), ("batch", None)),),
            measurements=(measured("shared-raw", 3, 50, sessions=2),),
        )
    )


def trial_failed() -> InspectReport:
    """The trial run failed: the static part and the error, nothing measured."""
    return report_of(
        inputs=(InputSpec("x", "float32", (1, 8), ("batch", None)),),
        trial={
            "error": "Got invalid dimensions for input: x",
            "outputs": [],
            "run_seconds": None,
            "device": None,
            "rejected_sizes": [{"inputs": ["x float32[batch=1, 8]"], "error": "bad dims"}],
        },
        error="One plain onnxruntime session of 'model.onnx' could not run on the inputs.",
    )


SCENARIOS: dict[str, Callable[[], InspectReport]] = {
    "everything": everything_on_the_cpu,
    "one-session-device": one_session_on_a_serializing_device,
    "plain-smaller": plain_sessions_are_smaller,
    "nothing-to-compare": nothing_to_compare,
    "trial-failed": trial_failed,
}


# --------------------------------------------------------------------------------------------
# The CLI on those reports


def run_cli(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    report: InspectReport,
    *args: str,
) -> tuple[int, str, str]:
    """``sharedml inspect model.onnx ARGS`` printing ``report``: (status, stdout, stderr)."""

    def fake_inspect(model: Any, **kw: Any) -> InspectReport:
        if report.error is not None:
            exc = MeasurementError(report.error)
            exc.report = report
            raise exc
        return report

    monkeypatch.setattr(inspect_module, "inspect", fake_inspect)
    capsys.readouterr()
    status = main(["inspect", "model.onnx", *args])
    out, err = capsys.readouterr()
    return status, out, err


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_the_text_report_is_unchanged(
    name: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    report = SCENARIOS[name]()
    status, out, err = run_cli(monkeypatch, capsys, report)
    matches_golden(f"{name}.txt", out)
    if report.error is None:
        assert (status, err) == (0, "")
    else:
        assert status != 0 and err == f"sharedml: error: {report.error}\n"


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_the_json_report_is_unchanged(
    name: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    report = SCENARIOS[name]()
    _status, out, _err = run_cli(monkeypatch, capsys, report, "--json")
    matches_golden(f"{name}.json", out)
    assert json.loads(out) == json.loads(json.dumps(report.to_dict()))


@pytest.mark.parametrize("width", [72, 160])
def test_the_console_width_decides_the_columns_as_before(width: int) -> None:
    from rich.console import Console

    buffer = io.StringIO()
    console = Console(file=buffer, width=width, highlight=False)
    render_text(everything_on_the_cpu(), plot=Path("memory.png"), console=console)
    # rich pads lines to the width; a terminal does not show it, and editors strip it
    text = "".join(line.rstrip() + "\n" for line in buffer.getvalue().splitlines())
    matches_golden(f"everything.{width}.txt", text)


def test_a_legacy_code_page_pipe_gets_the_same_report_in_ascii_boxes(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    raw = io.BytesIO()
    pipe = io.TextIOWrapper(raw, encoding="cp1252", newline="\n")
    monkeypatch.setattr(inspect_module, "inspect", lambda model, **kw: everything_on_the_cpu())
    with monkeypatch.context() as patched:
        patched.setattr(sys, "stdout", pipe)
        assert main(["inspect", "model.onnx"]) == 0
        pipe.flush()
    matches_golden("everything.cp1252.txt", raw.getvalue().decode("cp1252"))


def test_the_scenarios_reach_every_finding_and_section() -> None:
    """The golden files guard only what the scenarios reach: every kind of finding, here."""
    kinds = {f.kind for make in SCENARIOS.values() for f in make().findings}
    assert kinds >= {
        "input-sizes", "degenerate-inputs", "serialized-runs", "indexed-tables", "one-session",
        "pool-vs-plain", "single-vs-pool", "advice", "held-vs-trimmed", "prepacking-off",
        "derived-not-shared", "per-session-packing", "runtime-weights", "unshared-weights",
        "nonfinite-outputs", "numerics", "stopped", "none",
    }  # fmt: skip
    texts = "".join(p.read_text(encoding="utf-8") for p in GOLDEN.glob("*.txt"))
    for section in (
        "Weights in the file", "Not measured", "Memory with 1 session", "Memory with 4 sessions",
        "Weights at run time", "Projected PSS by session count", "Compressed weights (int8)",
        "Recommendation", "RSS", "USS", "PSS after", "sharedml itself:", "could not be measured",
        "Memory is read as",
        "Device memory not measurable", "Already prepared by sharedml", "prepare would move",
        "Not shared:", "more tables indexed by inputs", "traffic MiB", "device ┃",
        "\nWrote memory.png",
    ):  # fmt: skip
        assert section in texts, section

"""``sharedml inspect``: argument parsing and rendering of :class:`sharedml.InspectReport`.

Every figure printed here comes from the report object that :func:`sharedml.inspect` returns;
this module only parses arguments, shows progress and renders (rich tables, JSON, a PNG plot).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import secrets
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sharedml._errors import MeasurementError, missing_package
from sharedml._units import human_bytes, human_seconds
from sharedml.cli._cache import add_cache_dir_option
from sharedml.cli._providers import add_provider_arguments, provider_options

if TYPE_CHECKING:  # imported where used: ``sharedml --help`` loads neither onnx nor numpy
    from rich.console import Console, RenderableType
    from rich.table import Table

    from sharedml.inspection._report import InspectReport
    from sharedml.inspection._results import Measurement, MemoryPoint
    from sharedml.inspection._weights_summary import WeightsSummary

__all__ = [
    "add_parser",
    "parse_dims",
    "parse_shapes",
    "plot_figure",
    "render_text",
    "write_plot",
]


def add_parser(sub: Any) -> None:
    """Add the ``inspect`` subcommand to the CLI's subparsers."""
    from sharedml.inspection._strategies import registered_strategies

    strategies = registered_strategies()
    defaults = [s.name for s in strategies if s.default]
    listing = "\n".join(
        f"  {s.name:<22} {s.summary}{'' if s.default else ' (not measured by default)'}"
        for s in strategies
    )
    p = sub.add_parser(
        "inspect",
        help="report what a model holds and what N plain vs N shared sessions cost in memory",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Report a model's weights (how many bytes, where they sit, what prepare would move)\n"
            "and measure, each in a fresh process, the memory and time of N sessions per\n"
            "strategy. Without MODEL, a built-in demo model is generated and inspected."
        ),
        epilog=f"strategies (--strategy; default: {', '.join(defaults)}):\n{listing}",
    )
    p.add_argument(
        "model",
        nargs="*",
        help=(
            "the ONNX model (default: a built-in demo model); several models: a family, its "
            "distinct vs total weights and plain vs pooled memory over all of them"
        ),
    )
    p.add_argument(
        "--sessions",
        type=int,
        default=4,
        metavar="N",
        help=f"sessions (and threads) to measure, 1 to {MAX_SESSIONS} (default: %(default)s)",
    )
    add_provider_arguments(
        p,
        providers_help="execution providers in priority order, e.g. CUDAExecutionProvider "
        "(default: CPU)",
    )
    p.add_argument(
        "--dim",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        # The sizes of sharedml.model._inputs (PLAUSIBLE_*), not imported here: --help stays
        # fast. tests/inspection/test_measure.py checks that they agree.
        help="size of a symbolic input dimension; repeatable (default: chosen from the model: "
        "a batch of 1, an image's height and width at least 224 or its metadata's imgsz, "
        "other lengths 128, smaller where a plain session refuses those)",
    )
    p.add_argument(
        "--shape",
        action="append",
        default=[],
        metavar="INPUT=AxBxC",
        help="the whole shape of an input, e.g. images=1x3x320x320 (sets its symbolic dims for "
        "every input); repeatable",
    )
    p.add_argument(
        "--inputs",
        metavar="FEEDS.npz",
        help="real input values, an .npz by input name (numpy.savez); the rest is generated",
    )
    p.add_argument(
        "--strategy",
        action="append",
        dest="strategies",
        choices=[s.name for s in strategies],
        metavar="NAME",
        help="measure this strategy (repeatable; default: every default strategy, listed below)",
    )
    p.add_argument(
        "--compress",
        choices=["int8", "int4"],
        help="also measure a pool over the model's MatMul/Gemm weights compressed to 8- or 4-bit "
        "blocks (built once into the cache) and compare its outputs with the float model's",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument(
        "--plot",
        metavar="FILE.png",
        help="write a PNG of memory against session count (needs matplotlib)",
    )
    add_cache_dir_option(p)  # the demo model and every measured pool use it
    p.set_defaults(func=_cmd_inspect)


# Each strategy creates N sessions and runs N threads at once in one fresh process, and the
# plain strategies hold a copy of the weights per session: 10^8 was accepted and would have
# spent hours creating sessions until memory ran out. Memory grows linearly in N past a few
# sessions, so the report's projection answers larger counts without creating them.
MAX_SESSIONS = 1024


def parse_dims(items: Sequence[str]) -> dict[str, int]:
    """``["batch=8", "seq=128"]`` -> ``{"batch": 8, "seq": 128}``.

    Raises:
        ValueError: an item that is not ``NAME=VALUE`` with an integer VALUE of at least 1
            (a dimension of 0 makes an empty input, which measures nothing).
    """
    dims: dict[str, int] = {}
    for item in items:
        name, sep, value = item.partition("=")
        name, value = name.strip(), value.strip()
        if not sep or not name or not value.isdigit() or int(value) < 1:
            raise ValueError(
                f"--dim {item!r}: expected NAME=VALUE with an integer VALUE of at least 1, "
                "e.g. --dim batch=8."
            )
        dims[name] = int(value)
    return dims


def parse_shapes(items: Sequence[str]) -> dict[str, tuple[int, ...]]:
    """``["images=1x3x320x320"]`` -> ``{"images": (1, 3, 320, 320)}`` (as trtexec's --shapes).

    Raises:
        ValueError: an item that is not ``INPUT=AxBxC`` with sizes of at least 1.
    """
    shapes: dict[str, tuple[int, ...]] = {}
    for item in items:
        name, sep, value = item.rpartition("=")
        sizes = value.strip().lower().split("x")
        if not sep or not name.strip() or not all(v.isdigit() and int(v) >= 1 for v in sizes):
            raise ValueError(
                f"--shape {item!r}: expected INPUT=AxBxC with sizes of at least 1, "
                "e.g. --shape images=1x3x320x320."
            )
        shapes[name.strip()] = tuple(int(v) for v in sizes)
    return shapes


def _check_plot_target(path: Path, inputs: Sequence[str | None] = ()) -> None:
    """Fail before measuring (which takes a while) rather than after it.

    ``inputs``: the files the command reads (the model, ``--inputs``), which the plot must not
    replace.
    """
    if path.suffix.lower() != ".png":
        raise ValueError(f"--plot writes a PNG file; name it *.png, not '{path}'.")
    from sharedml.prepared._files import check_outputs

    sources = [(Path(p), f"an input of this command, '{p}'") for p in inputs if p]
    check_outputs([path], sources, writer="--plot", fix="name another file for the plot")
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise FileNotFoundError(f"--plot: folder '{folder}' does not exist.")
    if not os.access(folder, os.W_OK):
        raise PermissionError(f"--plot: folder '{folder}' is not writable.")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise missing_package("--plot", "matplotlib", "plot") from None


@contextlib.contextmanager
def _progress_display() -> Iterator[Callable[[str, int, int], None] | None]:
    """A rich progress display on stderr when it is a terminal, else one line per step.

    Piped or logged, a bar would be noise and silence would look like a hang: each new stage
    (the trial run, each strategy) gets one line on stderr.
    """
    if not sys.stderr.isatty():
        last = [""]

        def line(description: str, done: int, total: int) -> None:
            if not total:
                return  # before measuring (building the demo): quick, and not a stage
            stage = description.split(":")[0]
            if stage != last[0]:
                last[0] = stage
                counted = f" ({done}/{total} sessions measured)" if total else ""
                print(f"sharedml inspect: {description}{counted}", file=sys.stderr, flush=True)

        yield line
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    with Progress(
        SpinnerColumn(),
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
    ) as bar:
        task = bar.add_task("inspecting", total=None)

        def update(description: str, done: int, total: int) -> None:
            bar.update(task, description=description, completed=done, total=total or None)

        yield update


def _cmd_inspect_family(args: argparse.Namespace) -> int:
    from sharedml.inspection._family import inspect_family

    report = inspect_family(
        args.model,
        sessions=args.sessions,
        dims=parse_dims(args.dim),
        shapes=parse_shapes(args.shape),
        inputs=args.inputs,
    )
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
        return 0
    print(f"family of {len(report.models)} models: {', '.join(report.models)}")
    print(
        f"weights: {human_bytes(report.distinct_bytes)} distinct of "
        f"{human_bytes(report.total_bytes)} in all ({report.tensors_distinct} distinct tensors "
        f"of {report.tensors_total})"
    )
    if report.plain_bytes is not None and report.pooled_bytes is not None:
        ratio = report.pooled_bytes / report.plain_bytes if report.plain_bytes > 0 else 0.0
        print(
            f"{report.sessions} sessions per model, PSS growth of one process: plain sessions "
            f"{human_bytes(report.plain_bytes)}, pools {human_bytes(report.pooled_bytes)} "
            f"({ratio:.2f}x; routes: {', '.join(report.mechanisms)})"
        )
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    from sharedml.inspection._inspect import InspectReport, inspect

    if not 1 <= args.sessions <= MAX_SESSIONS:
        raise ValueError(
            f"--sessions must be between 1 and {MAX_SESSIONS}, not {args.sessions}: each "
            "strategy creates that many sessions (plain ones with a copy of the weights each) "
            "and threads in one process. Measure a few and read larger counts from the "
            "report's memory projection."
        )
    if len(args.model) > 1:
        if args.compress:
            raise ValueError("--compress inspects one model; give one model file.")
        return _cmd_inspect_family(args)
    args.model = args.model[0] if args.model else None
    chosen = provider_options(args)
    dims = parse_dims(args.dim)
    shapes = parse_shapes(args.shape)
    plot = Path(args.plot) if args.plot else None
    if plot is not None:
        _check_plot_target(plot, (args.model, args.inputs))
    try:
        with _progress_display() as progress:
            report = inspect(
                args.model,
                sessions=args.sessions,
                providers=args.providers,
                ep_libraries=chosen.get("ep_libraries"),
                ep_devices=chosen.get("ep_devices"),
                dims=dims,
                shapes=shapes,
                feeds=args.inputs,
                strategies=args.strategies,
                progress=progress,
                compress=args.compress,
            )
    except MeasurementError as exc:
        if not isinstance(exc.report, InspectReport):
            raise
        _print_report(exc.report, json_out=args.json, plot=None)  # what needed no run
        raise
    if plot is not None:
        write_plot(report, plot)
    _print_report(report, json_out=args.json, plot=plot)
    return 0


class _TextFor(io.StringIO):
    """A text buffer that says it has ``stream``'s encoding (a ``StringIO`` says none)."""

    def __init__(self, stream: Any) -> None:
        super().__init__()
        self._encoding = getattr(stream, "encoding", None) or "utf-8"

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return self._encoding


def _print_report(report: InspectReport, *, json_out: bool, plot: Path | None) -> None:
    if json_out:
        print(json.dumps(report.to_dict(), indent=2))
    elif sys.stdout.isatty():
        render_text(report, plot=plot)
    else:
        # Piped: plain text, 100 columns, no trailing blanks; ASCII boxes where the pipe's
        # encoding is not UTF (rich draws them from the file's ``encoding``).
        from rich.console import Console

        buffer = _TextFor(sys.stdout)
        render_text(report, plot=plot, console=Console(file=buffer, width=100, highlight=False))
        sys.stdout.write("".join(line.rstrip() + "\n" for line in buffer.getvalue().splitlines()))
        sys.stdout.flush()


# --------------------------------------------------------------------------------------------
# Rendering


def _mib(n: float | None) -> str:
    """A figure for a table whose header says MiB: ``1234.5``; ``n/a`` for None."""
    if n is None:
        return "n/a"
    value = n / 2**20
    return f"{value:.1f}" if abs(value) < 10_000 else f"{value:.0f}"


def _vs_plain(m: Measurement) -> str:
    """The numerics column: '=' bitwise equal to a default plain session, else the largest gap."""
    if m.plain_outputs_nonfinite:
        return "NaN/inf"  # not compared: NaN in the same places proves nothing
    if m.matches_plain is None:
        return "n/a"
    if m.matches_plain:
        return "="
    if m.plain_max_abs_diff is None:
        return "shape!"
    return f"{m.plain_max_abs_diff:.1e}"


# Columns of the memory table that give way, in this order, when the console is narrow (the
# JSON has them all): a header cut to "sess…" helps nobody.
_OPTIONAL = ("RSS", "USS", "trimmed")
_TABLES_SHOWN = 3


def _rounds_text(points: Sequence[MemoryPoint]) -> str:
    """How often the sessions ran before memory was read: ``run 3 times, until memory settled``."""
    counts = sorted({p.rounds for p in points}) or [1]
    times = f"{counts[0]}" if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    if all(p.settled for p in points):
        return f"run {times} times, until memory settled"
    return f"run {times} times; memory still grew in the last round of some"


_Column = tuple[str, str, Callable[["Measurement"], str]]
"""A column of the memory table: key, header, the cell of a measurement."""


def _memory_table(report: InspectReport, width: int) -> tuple[Table, list[str]]:
    """The memory table, with as many optional columns as fit in ``width``; and those left out."""
    from rich.table import Table

    measurements = report.measurements
    metric = report.metric.upper()
    trimmed = all(m.trimmed for m in measurements)
    show_device = any(m.device_metric is not None or m.device_note for m in measurements)
    columns: list[_Column] = [
        ("strategy", "strategy", lambda m: m.strategy),
        (
            "total",
            f"{metric} held\nMiB" if trimmed else f"{metric}\nMiB",
            lambda m: _mib(m.total_bytes) + projected(m),
        ),
        ("per", "per extra\nsession MiB", lambda m: _mib(m.per_session_bytes)),
    ]
    if any(m.traffic_points for m in measurements):
        # What the sessions hold once traffic has read the tables the inputs index.
        columns.append(
            ("traffic", "after\ntraffic MiB", lambda m: _mib(m.traffic_bytes) + projected(m))
        )
    if trimmed:
        columns.append(
            ("trimmed", f"{metric} after\ntrim MiB", lambda m: _mib(m.trimmed_bytes) + projected(m))
        )
    for other, key in (("USS", "uss"), ("RSS", "rss")):
        if other != metric:
            columns.append((other, f"{other}\nMiB", _total_cell(key)))
    if show_device:
        columns.append(
            (
                "device",
                "device\nMiB",
                lambda m: _mib(m.points[-1].device_bytes if m.points else None),
            )
        )
    columns += [
        ("create", "create\nall", lambda m: human_seconds(m.init_seconds)),
        ("first", "first\nrun", lambda m: human_seconds(m.first_run_seconds)),
        ("plain", "vs plain\nmax diff", _vs_plain),
    ]

    def needed(chosen: list[_Column]) -> int:
        widest = [
            max([len(line) for line in header.splitlines()] + [len(cell(m)) for m in measurements])
            for _key, header, cell in chosen
        ]
        return sum(widest) + 3 * (len(chosen) - 1) + 2  # separators, the 2-column indent

    left_out: list[str] = []
    for key in _OPTIONAL:
        if needed(columns) <= width:
            break
        if any(c[0] == key for c in columns):
            columns = [c for c in columns if c[0] != key]
            left_out.append(f"{metric} after malloc_trim" if key == "trimmed" else key)
    table = Table(show_edge=False, pad_edge=False)
    for key, header, _cell in columns:
        table.add_column(header, justify="left" if key == "strategy" else "right", no_wrap=True)
    for m in measurements:
        table.add_row(*(cell(m) for _key, _header, cell in columns))
    return table, left_out


def _total_cell(metric: str) -> Callable[[Measurement], str]:
    """A column's cell: a measurement's total in ``metric``, MiB."""
    return lambda m: _mib(m.total(metric))


def projected(m: Measurement) -> str:
    """``*`` after a total that was projected because measuring stopped early."""
    return "*" if m.measured_sessions != m.sessions else ""


class _Page:
    """The console a report is printed on: headings, indented paragraphs and tables."""

    def __init__(self, console: Console) -> None:
        self.console = console

    def heading(self, title: str, rest: str = "") -> None:
        """A bold title, and ``rest`` after it in plain text."""
        from rich.text import Text

        self.console.print(Text.assemble((title, "bold"), rest))

    def para(self, text: str, indent: int = 2) -> None:
        """A paragraph, wrapped to the console, indented by ``indent`` columns."""
        from rich.text import Text

        self.indented(Text(text), indent)

    def indented(self, renderable: RenderableType, indent: int = 2) -> None:
        """A table (or any rich renderable), indented by ``indent`` columns."""
        from rich.padding import Padding

        self.console.print(Padding(renderable, (0, 0, 0, indent), expand=False))

    def blank(self) -> None:
        """An empty line: the end of a section."""
        self.console.print()


def render_text(
    report: InspectReport, *, plot: Path | None = None, console: Console | None = None
) -> None:
    """Print ``report`` (an :class:`~sharedml.InspectReport`) as tables on ``console``.

    A partial report (``report.error``: the trial run failed) prints its static part and the
    error; nothing measured is invented.
    """
    from rich.console import Console

    page = _Page(console or Console(highlight=False))
    _inspected(page, report)
    _weights_in_the_file(page, report)
    if report.error is not None or not report.measurements:
        page.heading("Not measured")
        page.para(report.error or "No strategy was measured.")
        return
    _memory(page, report)
    _weights_at_run_time(page, report)
    _projection(page, report)
    _compressed(page, report)
    _recommendation(page, report, plot)


def _inspected(page: _Page, report: InspectReport) -> None:
    """What was inspected: the model, onnxruntime, the providers and device, the inputs."""
    if report.demo:
        page.heading("sharedml inspect", ": the built-in demo model (an MLP generated by sharedml)")
    else:
        page.heading("sharedml inspect", f": {report.model_path.name}")
    page.para(str(report.model_path))
    device = report.device
    page.para(
        f"onnxruntime {report.onnxruntime_version}, {', '.join(report.providers)}"
        f"{f' (device: {device})' if device and device != 'CPU' else ''}"
        f"; inputs: {', '.join(i.describe() for i in report.inputs) or 'none'}"
    )
    page.blank()


def _weights_in_the_file(page: _Page, report: InspectReport) -> None:
    """The static part: where the weights sit, the largest, the tables inputs index, prepare."""
    w = report.weights
    page.heading("Weights in the file", f"  {human_bytes(w.total_bytes)} in {w.tensors} tensors")
    page.indented(_placements_grid(w))
    for table in report.tables[:_TABLES_SHOWN]:
        page.para(
            f"indexed by {'input ' + repr(table.input) if table.input else 'computed indices'} "
            f"({table.op}): {table.name} {table.dtype}[{'x'.join(map(str, table.shape))}] "
            f"{human_bytes(table.nbytes)}, read only at the rows indexed"
        )
    if len(report.tables) > _TABLES_SHOWN:
        page.para(f"and {len(report.tables) - _TABLES_SHOWN} more tables indexed by inputs")
    if w.already_prepared:
        page.para("Already prepared by sharedml: the pool maps its weights file as it is.")
    else:
        converts = (
            f"; {w.prepare_converts_constants} Constant nodes become initializers"
            if w.prepare_converts_constants
            else ""
        )
        leaves = (
            f"{w.prepare_leaves_tensors} small tensors ({human_bytes(w.prepare_leaves_bytes)}: "
            "initializers and Constant nodes under 1 KiB) stay in the graph"
            if w.prepare_leaves_tensors
            else "no initializer or Constant stays in the graph"
        )
        page.para(
            f"prepare would move {w.prepare_moves_tensors} tensors "
            f"({human_bytes(w.prepare_moves_bytes)}) into one aligned, mappable weights file; "
            f"{leaves}{converts}."
        )
    unshared_tensors, unshared_bytes = w.unshared
    if unshared_bytes >= 0.01 * max(w.total_bytes, 1):  # a ConstantOfShape's 4 B is not news
        page.para(
            f"Not shared: {human_bytes(unshared_bytes)} in {unshared_tensors} node attributes or "
            "sparse initializers (ai.onnx.ml parameters, tensor attributes) stay in the graph, "
            "and every session keeps its own copy."
        )
    page.blank()


def _placements_grid(w: WeightsSummary) -> Table:
    """Bytes per placement, per external file, and the largest tensors."""
    from rich.table import Table

    grid = Table.grid(padding=(0, 2))
    grid.add_column()
    grid.add_column()
    grid.add_column()
    grid.add_column(justify="right")
    for p in w.placements:
        grid.add_row(p.placement, f"{p.tensors} tensors", "", human_bytes(p.nbytes))
    for file, nbytes in w.external_files:
        grid.add_row("", f"file {file}", "", human_bytes(nbytes))
    several = len(w.placements) > 1
    for i, t in enumerate(w.largest):
        shape = "x".join(str(d) for d in t.shape) or "scalar"
        where = f" ({t.placement})" if several else ""
        grid.add_row(
            "largest" if i == 0 else "", t.name, f"{t.dtype}[{shape}]{where}", human_bytes(t.nbytes)
        )
    return grid


def _memory(page: _Page, report: InspectReport) -> None:
    """The measured part: the memory table, its legend, what the figures are, notes."""
    from rich.table import Table

    measurements, n = report.measurements, report.sessions
    concurrently = all(m.concurrent for m in measurements)
    rounds = _rounds_text([m.points[-1] for m in measurements if m.points])
    if n == 1:
        page.heading("Memory with 1 session", f"  ({rounds})")
    else:
        page.heading(
            f"Memory with {n} sessions",
            f"  ({rounds}, {'all at once' if concurrently else 'one after another'}, "
            "one thread each)",
        )
    table, left_out = _memory_table(report, page.console.width)
    page.indented(table)
    legend = Table.grid(padding=(0, 2))
    legend.add_column(no_wrap=True)
    legend.add_column()
    for m in measurements:
        legend.add_row(m.strategy, m.summary)
    page.indented(legend)
    page.blank()
    page.para(_what_the_figures_are(report, left_out))
    fixed = report.fixed_cost
    if fixed is not None and fixed.error is None:
        total, imports = report.fixed_bytes, fixed.imports_bytes(report.metric)
        page.para(
            f"sharedml itself: {human_bytes(total)} ({report.metric.upper()}) once per process, "
            f"whatever its pools hold: its imports ({human_bytes(imports)}) and its "
            "session-creation thread. A fresh process that had run onnxruntime alone grew by "
            "the pool's figure plus this when it opened the same pool. The pooled rows leave it "
            "out; the recommendation counts it wherever a pool is compared with plain sessions."
        )
    elif fixed is not None:
        page.para(f"sharedml's own per-process cost could not be measured: {fixed.error}")
    for note in sorted({m.metric_note for m in measurements if m.metric_note}):
        page.para(f"Memory is read as {note}.")
    for note in sorted({m.device_note for m in measurements if m.device_note}):
        page.para(f"Device memory {note}.")
    for m in measurements:
        if m.stopped_reason:
            page.para(f"* {m.strategy}: {m.stopped_reason}.")
    page.blank()


def _what_the_figures_are(report: InspectReport, left_out: Sequence[str]) -> str:
    """The paragraph under the memory table: what was measured, over what, held or trimmed."""
    measurements = report.measurements
    baseline = max((m.baseline_bytes for m in measurements), default=0)
    trimmed = all(m.trimmed for m in measurements)
    return (
        f"Each strategy ran in a fresh process. Figures are the growth of its "
        f"{report.metric.upper()} over the same process with onnxruntime loaded (about "
        f"{human_bytes(baseline)}, not counted)"
        + (
            ", as a server holds it after concurrent traffic: nothing was trimmed, so the free "
            "heap that glibc kept after creating and running the sessions counts (no other "
            "process can use it). 'after trim' is the same process once malloc_trim gave that "
            "heap back: what the sessions themselves hold. The comparisons and the advice use "
            "the held figures."
            if trimmed
            else "."
        )
        + " First run: one timed run of one session, alone; not a throughput figure. 'vs plain':"
        " the first outputs against a default plain session's ('=' bitwise equal, else the "
        "largest absolute difference)."
        + (f" Left out to fit this width (in --json): {', '.join(left_out)}." if left_out else "")
    )


def _weights_at_run_time(page: _Page, report: InspectReport) -> None:
    """How each strategy holds the file's weights, those ORT derives and those it packs."""
    from rich.table import Table

    from sharedml.inspection._report import runtime_weights_by_strategy

    runtime = runtime_weights_by_strategy(report)
    if not runtime:
        return
    first = next(iter(runtime.values()))
    known = (
        f"ORT derives {human_bytes(first.derived_bytes)} and packs "
        f"{human_bytes(first.prepacked_bytes)} of weights from them (read from its saved "
        "optimized model)"
        if first.derived_bytes is not None
        else "what ORT derives and packs is unknown (no pooled strategy built its saved model)"
    )
    page.heading(
        "Weights at run time",
        f"  the file holds {human_bytes(report.weights.total_bytes)}; {known}",
    )
    grid = Table(show_edge=False, pad_edge=False)
    for header in ("strategy", "per extra\nsession MiB", "file's\nweights", "derived", "packed"):
        grid.add_column(header, no_wrap=True, justify="left")
    for name, row in runtime.items():
        grid.add_row(name, _mib(row.per_session_bytes), row.file_weights, row.derived, row.packed)
    page.indented(grid)
    page.para("once: one copy for all sessions (mapped); per session: each session its own copy.")
    page.blank()


def _projection(page: _Page, report: InspectReport) -> None:
    """Memory projected to other session counts, where a strategy has a fit."""
    from rich.table import Table

    if not any(m.fit() is not None for m in report.measurements):
        return
    page.heading(
        f"Projected {report.metric.upper()} by session count, MiB",
        f"  (least-squares line through the measured 1..{report.sessions}"
        + (", after runs over the tables' rows)" if report.after_traffic else ")"),
    )
    table = Table(show_edge=False, pad_edge=False)
    table.add_column("strategy", no_wrap=True)
    for count in report.projection_sessions:
        table.add_column(str(count), justify="right", no_wrap=True)
    for m in report.measurements:
        values = report.projection(m.strategy)
        table.add_row(m.strategy, *(_mib(values[c]) for c in report.projection_sessions))
    page.indented(table)
    page.blank()


def _compressed(page: _Page, report: InspectReport) -> None:
    """The compressed model against the float one, with ``--compress``."""
    if report.compressed is None:
        return
    page.heading(
        f"Compressed weights ({report.compressed.weights})",
        "  (MatMul/Gemm weights in blocks; against the float model, on the inputs above)",
    )
    for line in compressed_lines(report):
        page.para(line)
    page.blank()


def _recommendation(page: _Page, report: InspectReport, plot: Path | None) -> None:
    """The findings, one paragraph each; and where the plot went."""
    page.heading("Recommendation")
    for finding in report.findings:
        page.para(f"- {finding.text}")
    if not report.findings:
        page.para(report.recommendation)
    if plot is not None:
        page.blank()
        page.para(f"Wrote {plot}", indent=0)


def compressed_lines(report: InspectReport) -> list[str]:
    """The compressed-weights section: memory and first run against the float pool, accuracy.

    Empty where the report has no compressed model.
    """
    c = report.compressed
    if c is None:
        return []
    by_name = report.strategies
    lines = []
    mine, floats = by_name.get(c.strategy), by_name.get("shared")
    if mine is not None:
        memory = f"memory ({report.metric.upper()}, {mine.measured_sessions} sessions): "
        memory += f"{_mib(mine.total_bytes)} MiB"
        if floats is not None and floats.total_bytes and mine.total_bytes is not None:
            ratio = mine.total_bytes / floats.total_bytes
            memory += f" against {_mib(floats.total_bytes)} MiB float ({ratio:.2f}x)"
        lines.append(memory)
        first, float_first = mine.first_run_seconds, floats and floats.first_run_seconds
        if first is not None:
            speed = f"first run: {human_seconds(first)}"
            if float_first:
                speed += f" against {human_seconds(float_first)} float"
            lines.append(speed + " (one run of one session, alone: not a throughput figure)")
    if c.error is not None:
        lines.append(f"accuracy: not compared, the compressed model failed: {c.error}")
    elif not c.outputs:
        lines.append("accuracy: not compared (no float outputs of the same shape)")
    for o in c.outputs:
        text = (
            f"{o.name}: largest difference {o.max_abs_diff:.3g} ({o.max_rel_diff:.2%} of the "
            "float output's largest magnitude)"
        )
        if o.top1_agreement is not None:
            agree = round(o.top1_agreement * o.top1_rows)
            text += f", top-1 agreement {agree}/{o.top1_rows} rows ({o.top1_agreement:.0%})"
        lines.append(text)
    return lines


def plot_figure(report: InspectReport) -> Any:
    """The figure :func:`write_plot` saves: memory against session count, one line a strategy.

    Both axes are logarithmic: the strategies differ by factors (a pool at 0.1x of plain
    sessions), which a linear axis squeezes against zero, and session counts double. Measured
    points are joined by solid lines, the least-squares projection continues dashed to the
    largest projected count, and each line is labelled at its end; the title names the model,
    the provider and the inputs (with their dims).

    Raises:
        SharedMLError: matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed, and never a window
        import matplotlib.pyplot as plt
    except ImportError:
        raise missing_package("--plot", "matplotlib", "plot") from None

    metric = report.metric.upper()
    fig, ax = plt.subplots(figsize=(9, 5.5), dpi=100)
    top = max(report.projection_sessions)
    markers = "osD^vP*X"
    floor = 0.1  # MiB: a log axis has no zero; smaller figures are drawn here
    ends: list[tuple[float, str, Any]] = []
    for i, m in enumerate(report.measurements):
        xs = [p.sessions for p in m.points]
        ys = [max(floor, (p.value(m.metric) or 0) / 2**20) for p in m.points]
        (line,) = ax.plot(
            xs, ys, marker=markers[i % len(markers)], linestyle="-", label=m.strategy, alpha=0.9
        )
        end_y = ys[-1] if ys else floor
        fit = m.fit()
        if fit is not None and xs:
            fx = [xs[-1], top]
            fy = [max(floor, (fit[0] + fit[1] * x) / 2**20) for x in fx]
            ax.plot(fx, fy, "--", color=line.get_color(), alpha=0.6)
            end_y = fy[-1]
        ends.append((end_y, m.strategy, line.get_color()))
    # Labels at the line ends, nudged apart where lines end close together.
    placed: list[float] = []
    for y, name, color in sorted(ends):
        label_y = y
        for other in placed:
            if abs(math.log10(label_y) - math.log10(other)) < 0.06:
                label_y = other * 10**0.06
        placed.append(label_y)
        ax.annotate(
            name,
            (top, y),
            xytext=(top * 1.08, label_y),
            color=color,
            fontsize="small",
            va="center",
            annotation_clip=False,
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ticks = list(report.projection_sessions)
    ax.set_xticks(ticks)
    ax.set_xticklabels([str(t) for t in ticks])
    ax.set_xlim(min(ticks) / 1.15, top * 1.15)
    ax.set_xlabel("sessions (log scale)")
    ax.set_ylabel(f"memory ({metric} growth, MiB, log scale)")
    name = "demo model" if report.demo else report.model_path.name
    inputs = ", ".join(i.describe() for i in report.inputs)
    ax.set_title(
        f"sharedml inspect: {name}, {report.providers[0]}\ninputs: {inputs}\n"
        "solid: measured; dashed: least-squares projection",
        fontsize="medium",
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small", loc="upper left")
    fig.tight_layout(rect=(0, 0, 0.84, 1))  # room on the right for the labels at the line ends
    return fig


def write_plot(report: InspectReport, path: Path) -> None:
    """Write :func:`plot_figure` as a PNG. The file appears atomically: nothing is left on failure.

    Raises:
        SharedMLError: matplotlib is not installed.
        OSError: the file cannot be written.
    """
    fig = plot_figure(report)
    import matplotlib.pyplot as plt

    try:
        folder = path.parent if str(path.parent) else Path(".")
        # A fresh name beside the target ("x": never an existing file), honouring the umask.
        tmp = folder / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        try:
            with open(tmp, "xb") as fh:
                fig.savefig(fh, format="png")
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
    finally:
        plt.close(fig)

"""``sharedml inspect``: argument parsing and rendering of :class:`sharedml.InspectReport`.

Every figure printed here comes from the report object that :func:`sharedml.inspect` returns;
this module only parses arguments, shows progress and renders (rich tables, JSON, a PNG plot).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import secrets
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from sharedml._errors import missing_package
from sharedml._format import human_bytes, human_seconds

__all__ = ["add_parser", "parse_dims", "render_text", "write_plot"]


def add_parser(sub: Any) -> None:
    """Add the ``inspect`` subcommand to the CLI's subparsers."""
    from sharedml._strategies import registered_strategies

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
    p.add_argument("model", nargs="?", help="the ONNX model (default: a built-in demo model)")
    p.add_argument(
        "--sessions",
        type=int,
        default=4,
        metavar="N",
        help="sessions (and threads) to measure (default: %(default)s)",
    )
    p.add_argument(
        "--providers",
        nargs="+",
        default=None,
        metavar="P",
        help="execution providers in priority order, e.g. CUDAExecutionProvider (default: CPU)",
    )
    p.add_argument(
        "--dim",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="size of a symbolic input dimension (default 1); repeatable",
    )
    p.add_argument(
        "--strategy",
        action="append",
        dest="strategies",
        choices=[s.name for s in strategies],
        metavar="NAME",
        help="measure this strategy (repeatable; default: every default strategy, listed below)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument(
        "--plot",
        metavar="FILE.png",
        help="write a PNG of memory against session count (needs matplotlib)",
    )
    p.set_defaults(func=_cmd_inspect)


def parse_dims(items: Sequence[str]) -> dict[str, int]:
    """``["batch=8", "seq=128"]`` -> ``{"batch": 8, "seq": 128}``.

    Raises:
        ValueError: an item that is not ``NAME=VALUE`` with a non-negative integer VALUE.
    """
    dims: dict[str, int] = {}
    for item in items:
        name, sep, value = item.partition("=")
        name, value = name.strip(), value.strip()
        if not sep or not name or not value.isdigit():
            raise ValueError(
                f"--dim {item!r}: expected NAME=VALUE with a non-negative integer VALUE, "
                "e.g. --dim batch=8."
            )
        dims[name] = int(value)
    return dims


def _check_plot_target(path: Path) -> None:
    """Fail before measuring (which takes a while) rather than after it."""
    if path.suffix.lower() != ".png":
        raise ValueError(f"--plot writes a PNG file; name it *.png, not '{path}'.")
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
    """A rich progress display on stderr when it is a terminal; nothing otherwise."""
    if not sys.stderr.isatty():
        yield None
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


def _cmd_inspect(args: argparse.Namespace) -> int:
    from sharedml._inspect import inspect

    if args.sessions < 1:
        raise ValueError(f"--sessions must be at least 1, not {args.sessions}.")
    dims = parse_dims(args.dim)
    plot = Path(args.plot) if args.plot else None
    if plot is not None:
        _check_plot_target(plot)
    with _progress_display() as progress:
        report = inspect(
            args.model,
            sessions=args.sessions,
            providers=args.providers,
            dims=dims,
            strategies=args.strategies,
            progress=progress,
        )
    if plot is not None:
        write_plot(report, plot)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    elif sys.stdout.isatty():
        render_text(report, plot=plot)
    else:
        # Piped: plain text, 100 columns (the memory table needs them), no trailing blanks.
        from rich.console import Console

        buffer = io.StringIO()
        render_text(report, plot=plot, console=Console(file=buffer, width=100, highlight=False))
        sys.stdout.write("".join(line.rstrip() + "\n" for line in buffer.getvalue().splitlines()))
    return 0


# --------------------------------------------------------------------------------------------
# Rendering


def render_text(report: Any, *, plot: Path | None = None, console: Any = None) -> None:
    """Print ``report`` (an :class:`~sharedml.InspectReport`) as tables on ``console``."""
    from rich.console import Console
    from rich.padding import Padding
    from rich.table import Table
    from rich.text import Text

    out = console or Console(highlight=False)
    w = report.weights
    metric = report.metric.upper()
    n = report.sessions
    measurements = report.measurements

    def para(text: str | Text, indent: int = 2) -> None:
        out.print(
            Padding(text if isinstance(text, Text) else Text(text), (0, 0, 0, indent), expand=False)
        )

    def heading(title: str, rest: str = "") -> None:
        out.print(Text.assemble((title, "bold"), rest))

    # ---- what was inspected
    if report.demo:
        heading("sharedml inspect", ": the built-in demo model (an MLP generated by sharedml)")
    else:
        heading("sharedml inspect", f": {report.model_path.name}")
    para(str(report.model_path))
    para(
        f"onnxruntime {report.onnxruntime_version}, {', '.join(report.providers)}; inputs "
        f"generated: {', '.join(i.describe() for i in report.inputs) or 'none'}"
    )
    out.print()

    # ---- static part
    heading("Weights", f"  {human_bytes(w.total_bytes)} in {w.tensors} tensors")
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
    out.print(Padding(grid, (0, 0, 0, 2), expand=False))
    if w.already_prepared:
        para("Already prepared by sharedml: the pool maps its weights file as it is.")
    else:
        converts = (
            f"; {w.prepare_converts_constants} Constant nodes become initializers"
            if w.prepare_converts_constants
            else ""
        )
        leaves = (
            f"{w.prepare_leaves_tensors} small tensors ({human_bytes(w.prepare_leaves_bytes)}) "
            "stay in the graph"
            if w.prepare_leaves_tensors
            else "no weight stays in the graph"
        )
        para(
            f"prepare would move {w.prepare_moves_tensors} tensors "
            f"({human_bytes(w.prepare_moves_bytes)}) into one aligned, mappable weights file; "
            f"{leaves}{converts}."
        )
    out.print()

    # ---- measured part
    concurrently = all(m.concurrent for m in measurements)
    trimmed = all(m.trimmed for m in measurements)
    if n == 1:
        heading("Memory with 1 session", "  (run once)")
    else:
        heading(
            f"Memory with {n} sessions",
            f"  (each run once, {'all at once' if concurrently else 'one after another'}, "
            "one thread each)",
        )
    show_device = any(m.device_metric is not None or m.device_note for m in measurements)
    others = [o for o in ("USS", "RSS") if o != metric]
    table = Table(show_edge=False, pad_edge=False)
    table.add_column("strategy", no_wrap=True)
    table.add_column(metric, justify="right")
    table.add_column("per extra\nsession", justify="right")
    if trimmed:
        table.add_column(f"{metric} before\nmalloc_trim", justify="right")
    for other in others:
        table.add_column(other, justify="right")
    if show_device:
        table.add_column("device", justify="right")
    table.add_column("create\nall", justify="right")
    table.add_column("first\nrun", justify="right")
    for m in measurements:
        total = human_bytes(m.total_bytes) + ("*" if m.measured_sessions != m.sessions else "")
        row = [m.strategy, total, human_bytes(m.per_session_bytes)]
        if trimmed:
            row.append(human_bytes(m.total("untrimmed")))
        row += [human_bytes(m.total(other.lower())) for other in others]
        if show_device:
            device = m.points[-1].device_bytes if m.points else None
            row.append(human_bytes(device) if device is not None else "n/a")
        row += [human_seconds(m.init_seconds), human_seconds(m.first_run_seconds)]
        table.add_row(*row)
    out.print(Padding(table, (0, 0, 0, 2), expand=False))
    legend = Table.grid(padding=(0, 2))
    legend.add_column(no_wrap=True)
    legend.add_column()
    for m in measurements:
        legend.add_row(m.strategy, m.summary)
    out.print(Padding(legend, (0, 0, 0, 2), expand=False))
    out.print()
    baseline = max((m.baseline_bytes for m in measurements), default=0)
    para(
        f"Each strategy ran in a fresh process. Figures are the growth of its {metric} over the "
        f"same process with onnxruntime loaded (about {human_bytes(baseline)}, not counted)"
        + (
            ", read after malloc_trim gave freed heap back to the OS: what the sessions hold. "
            f"'{metric} before malloc_trim' is what the process held, including free heap that "
            "glibc kept after creating the sessions; it varies from run to run."
            if trimmed
            else "."
        )
        + " First run: one timed run of one session, alone; not a throughput figure."
    )
    for note in sorted({m.device_note for m in measurements if m.device_note}):
        para(f"Device memory {note}.")
    for m in measurements:
        if m.stopped_reason:
            para(f"* {m.strategy}: {m.stopped_reason}.")
    out.print()

    # ---- projection
    if any(m.fit() is not None for m in measurements):
        heading(
            f"Projected {metric} by session count",
            f"  (least-squares line through the measured 1..{n})",
        )
        proj = Table(show_edge=False, pad_edge=False)
        proj.add_column("strategy", no_wrap=True)
        for count in report.projection_sessions:
            proj.add_column(str(count), justify="right", no_wrap=True)
        for m in measurements:
            values = report.projection(m.strategy)
            proj.add_row(m.strategy, *(human_bytes(values[c]) for c in report.projection_sessions))
        out.print(Padding(proj, (0, 0, 0, 2), expand=False))
        out.print()

    heading("Recommendation")
    para(report.recommendation)
    if plot is not None:
        out.print()
        para(f"Wrote {plot}", indent=0)


def write_plot(report: Any, path: Path) -> None:
    """Write a PNG of memory against session count, one line per strategy.

    Measured points are markers; the fitted line runs on to the largest projected count.
    The file appears atomically: nothing is left behind on failure.

    Raises:
        SharedMLError: matplotlib is not installed.
        OSError: the file cannot be written.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed, and never a window
        import matplotlib.pyplot as plt
    except ImportError:
        raise missing_package("--plot", "matplotlib", "plot") from None

    metric = report.metric.upper()
    fig, ax = plt.subplots(figsize=(8, 5), dpi=100)
    try:
        top = max(report.projection_sessions)
        markers = "osD^vP*X"
        for i, m in enumerate(report.measurements):
            xs = [p.sessions for p in m.points]
            ys = [(p.value(m.metric) or 0) / 2**20 for p in m.points]
            (dots,) = ax.plot(xs, ys, markers[i % len(markers)], label=m.strategy, alpha=0.85)
            fit = m.fit()
            if fit is not None:
                fx = [1, top]  # a linear x axis, so that linear growth looks linear
                fy = [max(0.0, (fit[0] + fit[1] * x) / 2**20) for x in fx]
                ax.plot(fx, fy, "--", color=dots.get_color(), alpha=0.6)
        ticks = list(report.projection_sessions)
        ax.set_xticks(ticks)
        ax.set_xticklabels([str(t) for t in ticks])
        ax.set_xlim(0, top + 1)
        ax.set_ylim(bottom=0)
        ax.set_xlabel("sessions")
        ax.set_ylabel(f"memory ({metric} growth, MiB)")
        name = "demo model" if report.demo else report.model_path.name
        ax.set_title(
            f"sharedml inspect: {name}, {report.providers[0]}\n"
            "markers: measured; dashed: least-squares projection"
        )
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
        fig.tight_layout()
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

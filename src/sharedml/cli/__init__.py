"""The ``sharedml`` command: a thin layer over the library.

Every figure it prints comes from a library object; errors print one line and exit non-zero
(``--debug`` shows the traceback).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence

from sharedml._errors import SharedMLError
from sharedml._units import human_bytes

__all__ = ["main"]

EXIT_ERROR = 1  # usage errors exit with 2, from argparse itself
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: what a shell reports for a tool its reader left
_CACHE_ENV = "SHAREDML_CACHE_DIR"  # where sharedml.cache.cache_dir and child processes look
# prepare's defaults, for --help: importing sharedml.prepared._prepare would import onnx (seconds)
# just to
# print them; tests/test_prepare.py checks that they agree.
_THRESHOLD = 1024  # bytes
_ALIGNMENT = 4096  # bytes


@contextlib.contextmanager
def _progress(enabled: bool, description: str) -> Iterator[Callable[[int, int], None] | None]:
    """A rich progress bar on a terminal; nothing when piped or disabled."""
    if not enabled or not sys.stderr.isatty():
        yield None
        return
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    with Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        DownloadColumn(binary_units=True),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        transient=True,
    ) as bar:
        task = bar.add_task(description, total=None)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        yield update


def _cmd_prepare(args: argparse.Namespace) -> int:
    from sharedml.prepared._prepare import prepare

    options = {
        key: value
        for key, value in (
            ("size_threshold_bytes", args.threshold),
            ("alignment_bytes", args.alignment),
        )
        if value is not None
    }
    if len(args.model) > 1:
        return _prepare_family(args, options)
    with _progress(not args.json, "preparing") as progress:
        result = prepare(args.model[0], args.output, progress=progress, **options)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(
            f"wrote {result.model_path} and {result.weights_path}: "
            f"{result.tensors_moved} tensors ({human_bytes(result.bytes_moved)}) in the weights "
            f"file, {result.tensors_inline} small tensors ({human_bytes(result.bytes_inline)}) "
            f"inline, {result.constants_converted} Constant nodes turned into initializers"
        )
        print(
            "both files are read-only: running pools map the weights, and copying a file over "
            "them (cp) would crash those pools with SIGBUS. To redeploy, prepare again over "
            "them or rename (mv) new files into place."
        )
    return 0


def _prepare_family(args: argparse.Namespace, options: dict[str, int]) -> int:
    from sharedml.prepared._family import prepare_family

    with _progress(not args.json, "preparing") as progress:
        result = prepare_family(args.model, args.output, progress=progress, **options)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
        return 0
    names = ", ".join(p.name for p in result.model_paths)
    print(
        f"wrote {names} and {result.weights_path.name} in {result.weights_path.parent}: "
        f"{result.tensors_distinct} distinct tensors ({human_bytes(result.bytes_distinct)}) of "
        f"{result.tensors_total} ({human_bytes(result.bytes_total)} if stored per model)"
    )
    for removed in result.removed:
        print(f"removed {removed}: no graph in the folder refers to it any more")
    return 0


def _build_parser() -> argparse.ArgumentParser:
    from sharedml import __version__

    parser = argparse.ArgumentParser(
        prog="sharedml",
        description="Many ONNX Runtime sessions, one copy of the weights.",
    )
    parser.add_argument("--version", action="version", version=f"sharedml {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser(
        "prepare",
        help="move every weight of a model into one aligned, mappable weights file",
        description=(
            "Rewrite MODEL into OUTPUT (the graph) plus OUTPUT's stem + '.weights' beside it; "
            "an existing folder as OUTPUT means OUTPUT/<MODEL's stem>.onnx. The source model "
            "and its data files are never modified, and a failure leaves no file behind. "
            "Several MODELs (a family: graphs that hold the same tensors) go to the folder "
            "OUTPUT, each under its own file name, over ONE weights file holding each distinct "
            "tensor once."
        ),
    )
    p.add_argument("model", nargs="+", help="the ONNX model(s) to prepare")
    p.add_argument(
        "-o",
        "--output",
        required=True,
        help="the prepared graph file, or a folder to write it (or a family) into",
    )
    p.add_argument(
        "--threshold",
        type=int,
        metavar="BYTES",
        help=f"tensors at least this large move to the weights file (default: {_THRESHOLD})",
    )
    p.add_argument(
        "--alignment",
        type=int,
        metavar="BYTES",
        help=(
            "alignment of every tensor at least this large in the weights file; smaller ones "
            f"are packed at 64 bytes (a power of two from 4096 to 1 GiB; default: {_ALIGNMENT})"
        ),
    )
    p.add_argument("--json", action="store_true", help="print a JSON summary")
    p.set_defaults(func=_cmd_prepare)

    from sharedml.cli import _cache as _cli_cache
    from sharedml.cli import _inspect as _cli_inspect
    from sharedml.cli import _serve as _cli_serve

    _cli_inspect.add_parser(sub)
    _cli_cache.add_parser(sub)
    _cli_serve.add_parser(sub)
    return parser


@contextlib.contextmanager
def _cache_dir_env(folder: str | None) -> Iterator[None]:
    """``$SHAREDML_CACHE_DIR`` set to ``--cache-dir`` for one command, then restored.

    A command's work may run in child processes (``inspect`` measures each strategy in a fresh
    one), which find the cache by this variable; in this process every default cache resolves
    to it as well. Restored afterwards, so that ``main()`` called from Python leaves no trace.
    """
    if folder is None:
        yield
        return
    before = os.environ.get(_CACHE_ENV)
    os.environ[_CACHE_ENV] = os.path.abspath(folder)  # children may run elsewhere
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(_CACHE_ENV, None)
        else:
            os.environ[_CACHE_ENV] = before


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``sharedml`` console script; returns the exit status."""
    _replace_what_cannot_be_encoded()
    parser = _build_parser()
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        with _cache_dir_env(getattr(args, "cache_dir", None)):
            status = func(args)
        sys.stdout.flush()  # here, where a closed pipe is caught, not at interpreter exit
        return status
    except BrokenPipeError:
        return _reader_left()
    except KeyboardInterrupt:
        print("sharedml: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (SharedMLError, OSError, ValueError) as exc:
        if args.debug:
            raise
        print(f"sharedml: error: {_one_line(exc)}", file=sys.stderr)
        return EXIT_ERROR


def _replace_what_cannot_be_encoded() -> None:
    """A character the console or pipe cannot encode becomes ``?``, never an error.

    On Windows, a pipe or file (``sharedml inspect model.onnx > report.txt``) is written in
    the ANSI code page (cp1252 and the like) unless Python runs in UTF-8 mode, and a report's
    box lines or a model path's characters then raised ``UnicodeEncodeError`` after minutes of
    measuring.
    """
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            with contextlib.suppress(ValueError, io.UnsupportedOperation):
                reconfigure(errors="replace")


def _reader_left() -> int:
    """The reader of our output went away (``sharedml cache list | head -2``): stop quietly.

    Unix tools die of SIGPIPE there, silently, and the shell reports status 128 + SIGPIPE.
    Python ignores SIGPIPE (and so gets ``BrokenPipeError``); restoring the default handler
    instead would also kill the process on a pipe to a child that exited. So: no message, the
    same status, and stdout pointed at ``/dev/null`` so that the interpreter's final flush of
    what is still buffered does not fail again (the recipe of Python's ``signal`` docs).
    """
    with contextlib.suppress(OSError, ValueError, AttributeError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    return EXIT_BROKEN_PIPE


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return " ".join(text.split())


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

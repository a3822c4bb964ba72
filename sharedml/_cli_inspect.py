"""``sharedml inspect``: argument parsing and rendering of :class:`sharedml.InspectReport`."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["add_parser"]


def add_parser(sub: Any) -> None:
    """Add the ``inspect`` subcommand to the CLI's subparsers."""
    p = sub.add_parser(
        "inspect",
        help="report what a model holds and what N plain vs N shared sessions cost in memory",
    )
    p.add_argument("model", nargs="?", help="the ONNX model (default: a built-in demo model)")
    p.add_argument("--sessions", type=int, default=4, metavar="N")
    p.add_argument("--providers", nargs="+", default=None, metavar="P")
    p.add_argument("--dim", action="append", default=[], metavar="NAME=VALUE")
    p.add_argument("--json", action="store_true")
    p.add_argument("--plot", metavar="FILE.png")
    p.set_defaults(func=_cmd_inspect)


def _cmd_inspect(args: argparse.Namespace) -> int:
    raise NotImplementedError("inspect is being written (issue 4)")

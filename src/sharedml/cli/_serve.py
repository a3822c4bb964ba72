"""``sharedml serve``: the Open Inference Protocol over HTTP and gRPC, one pool per model."""

from __future__ import annotations

import argparse
import math
import textwrap
from typing import Any

from sharedml._units import parse_bytes
from sharedml.cli._providers import add_provider_arguments, provider_options

__all__ = ["add_parser"]

_EXAMPLES = """\
examples:
  sharedml serve model.onnx
      HTTP on 127.0.0.1:8000, gRPC on 127.0.0.1:8001; the model is /v2/models/model
  sharedml serve bert=models/bert.onnx resnet=models/resnet50.onnx --sessions 8
  sharedml serve model.onnx --name embedder --host 0.0.0.0 --http-port 9000 --no-grpc
  sharedml serve model.onnx --providers CUDAExecutionProvider CPUExecutionProvider
  sharedml serve model.onnx --providers WebGpuExecutionProvider   # a plugin EP, by name
  sharedml serve model.onnx --batching off --max-request-bytes 64M

a client (pip install 'tritonclient[http]'):
  import numpy as np, tritonclient.http as t
  c = t.InferenceServerClient("127.0.0.1:8000")
  x = t.InferInput("input", [1, 4], "FP32"); x.set_data_from_numpy(np.ones((1, 4), "float32"))
  print(c.infer("model", [x]).as_numpy("output"))
"""


def _size(text: str) -> int:
    value = parse_bytes(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least one byte")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive number of seconds")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port (0 to 65535; 0: any free one)")
    return value


def _sessions(text: str) -> int | str:
    return "auto" if text == "auto" else _positive_int(text)


def add_parser(sub: Any) -> None:
    """Add the ``serve`` subcommand to the CLI's subparsers."""
    from sharedml.cli._cache import add_cache_dir_option

    p = sub.add_parser(
        "serve",
        help="serve models over HTTP and gRPC (Open Inference Protocol: tritonclient, KServe)",
        description=textwrap.fill(
            "Serve each MODEL (PATH, or NAME=PATH) from one SessionPool shared by every "
            "request, over the Open Inference Protocol (KServe v2, Triton's API): HTTP (JSON "
            "and binary tensors) and gRPC (inference.GRPCInferenceService), plus Prometheus "
            "metrics at /metrics. Requests are merged into batches wherever the model's rows "
            "are proven independent. Ctrl-C or SIGTERM drains requests in flight, then stops. "
            "Needs the serve extra: pip install '.[serve]' in a checkout.",
            width=78,
        ),
        epilog=_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", nargs="+", metavar="MODEL", help="an ONNX model: PATH or NAME=PATH")
    p.add_argument("--name", help="the name clients use for the one MODEL (default: its stem)")
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="the address to listen on (default: %(default)s, this machine only; 0.0.0.0: all)",
    )
    p.add_argument(
        "--http-port", type=_port, default=8000, metavar="PORT", help="default: %(default)s"
    )
    p.add_argument(
        "--grpc-port", type=_port, default=8001, metavar="PORT", help="default: %(default)s"
    )
    p.add_argument("--no-grpc", action="store_true", help="serve HTTP only")
    p.add_argument(
        "--sessions",
        type=_sessions,
        metavar="N|auto",
        help="sessions per model's pool (default: the pool's); auto: measured",
    )
    p.add_argument(
        "--loop",
        choices=("auto", "asyncio", "uvloop"),  # serve._server.LOOPS, without its imports
        default="auto",
        help="the event loop every request's Python runs on: auto (default) uvloop where it "
        "is installed, else asyncio's",
    )
    p.add_argument(
        "--batching",
        choices=("auto", "on", "off"),
        default="auto",
        help="merge requests into batches: auto (default) where the row analysis proves it "
        "safe, on (fail for a model it cannot prove), off",
    )
    add_provider_arguments(
        p,
        providers_help="execution providers in priority order, as SessionPool(providers=) "
        "takes them, e.g. CUDAExecutionProvider CPUExecutionProvider or WebGpuExecutionProvider "
        "(default: the pool's)",
    )
    limits = p.add_argument_group("limits (per server process; see docs/serve.md)")
    limits.add_argument(
        "--max-request-bytes",
        type=_size,
        metavar="SIZE",
        help="the most one request's input arrays may take, e.g. 256M (default: 256M)",
    )
    limits.add_argument(
        "--max-inflight-bytes",
        type=_size,
        metavar="SIZE",
        help="the most all requests in flight may hold together (default: 1G)",
    )
    limits.add_argument(
        "--max-json-bytes", type=_size, metavar="SIZE", help="the largest JSON body (default: 8M)"
    )
    limits.add_argument(
        "--max-rows", type=_positive_int, metavar="N", help="rows per input (default: 65536)"
    )
    limits.add_argument(
        "--body-timeout-s",
        type=_seconds,
        metavar="S",
        help="the longest wait for the next piece of a body (default: 30)",
    )
    limits.add_argument(
        "--drain-timeout-s",
        type=_seconds,
        default=30.0,
        metavar="S",
        help="how long a stop waits for requests in flight (default: %(default)s)",
    )
    add_cache_dir_option(p)
    p.set_defaults(func=_cmd_serve)


def _cmd_serve(args: argparse.Namespace) -> int:
    try:
        import grpc  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise ValueError(
            f"sharedml serve needs the serve extra ({exc.name} is not installed): "
            "pip install '.[serve]' in a checkout of sharedml."
        ) from None
    from sharedml.pool._batching import BatchingSetting
    from sharedml.pool._options import PoolOptions
    from sharedml.protocol._admission import HttpLimits
    from sharedml.serve._server import Server, loop_runner, model_specs, served_batching

    loop_runner(args.loop)  # an event loop that is not installed fails before any pool opens

    given = {
        "max_request_bytes": args.max_request_bytes,
        "max_inflight_bytes": args.max_inflight_bytes,
        "max_json_bytes": args.max_json_bytes,
        "max_rows": args.max_rows,
        "body_timeout_s": args.body_timeout_s,
    }
    limits = HttpLimits(**{k: v for k, v in given.items() if v is not None})
    spelled: dict[str, BatchingSetting] = {"auto": "auto", "on": True, "off": False}
    pool_options = PoolOptions.from_arguments(  # every model's pool, checked once
        sessions=args.sessions,
        batching=served_batching(spelled[args.batching]),
        cache_dir=args.cache_dir,
        **provider_options(args),
    )
    server = Server(
        model_specs(args.model, args.name),
        host=args.host,
        http_port=args.http_port,
        grpc_port=None if args.no_grpc else args.grpc_port,
        pool_options=pool_options,
        limits=limits,
        drain_timeout_s=args.drain_timeout_s,
    )
    server.run(loop=args.loop)
    return 0

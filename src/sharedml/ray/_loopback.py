"""Keep a Serve replica's internal gRPC server on loopback (tests, single-host setups).

Every Ray Serve replica (Ray 2.60) starts an "inter-deployment" gRPC server bound to ``[::]:0``,
every interface, with no option to change it (``ray/serve/_private/replica.py`` calls
``add_port_to_grpc_server(server, "[::]:0")``). On a machine that must not listen beyond
loopback (a CI box, a laptop on a shared network, the tests of this package) that is one open
port per replica. :func:`bind_to_loopback` rewrites the address before the replica binds it.

It patches a private Ray function, so it is opt-in and named for what it does; it does nothing
where that function does not exist (another Ray version). It must be importable in every worker,
which is why it lives in this package and not next to a script (a setup hook Ray cannot import
makes the raylet restart workers in a loop, and ``serve.run`` then waits forever).
"""

from __future__ import annotations

from typing import Any

__all__ = ["bind_to_loopback"]

_ANY_HOSTS = ("[::]", "0.0.0.0", "")


def bind_to_loopback() -> None:
    """Ray ``worker_process_setup_hook``: bind Serve's replica gRPC servers to 127.0.0.1.

    Use: ``ray.init(runtime_env={"worker_process_setup_hook":
    "sharedml.ray.bind_to_loopback"})``; the Serve controller and replicas inherit the job's
    runtime environment. Idempotent.
    """
    try:
        import ray._common.tls_utils as tls_utils
    except ImportError:  # pragma: no cover - another Ray layout: nothing to patch
        return
    original = getattr(tls_utils, "add_port_to_grpc_server", None)
    if original is None or getattr(original, "_sharedml_loopback", False):
        return

    def add_port_on_loopback(server: Any, address: str) -> Any:
        host, _, port = address.rpartition(":")
        if host in _ANY_HOSTS:
            address = f"127.0.0.1:{port}"
        return original(server, address)

    add_port_on_loopback._sharedml_loopback = True  # type: ignore[attr-defined]
    tls_utils.add_port_to_grpc_server = add_port_on_loopback

"""Where a Serve replica's internal gRPC server listens: one address, not every interface.

Every Ray Serve replica (Ray 2.60) starts an "inter-deployment" gRPC server bound to ``[::]:0``,
every interface, with no option to change it (``ray/serve/_private/replica.py`` calls
``add_port_to_grpc_server(server, "[::]:0")`` once the replica's constructor has returned).
Serve's routers reach it, when they use gRPC at all (``RAY_SERVE_USE_GRPC_BY_DEFAULT``; by
default handles use Ray actor calls), at ``<node IP>:<port>``, the node's address as
``ray.util.get_node_ip_address()`` gives it in the replica. So that address is the only one the
server needs:

- :func:`restrict_replica_grpc` (what :class:`~sharedml.ray.ModelServer` calls in its
  constructor, so every :func:`~sharedml.ray.deployment` gets it): bind the node's address, which
  is 127.0.0.1 on a node started on loopback (a local deployment: nothing listens beyond it) and
  the node's network address otherwise (not the other interfaces: a VPN, a public one, docker
  bridges). Where this host cannot bind that address (a node advertised behind NAT), it leaves
  Ray's default and warns.
- :func:`bind_to_loopback`: a Ray worker setup hook putting every replica of the job on
  127.0.0.1, including replicas of other deployments (single-host setups, CI, tests).

Both rewrite the address of a private Ray function, so they do nothing where that function does
not exist (another Ray version). The hook must be importable in every worker, which is why it
lives in this package and not next to a script (a setup hook Ray cannot import makes the raylet
restart workers in a loop, and ``serve.run`` then waits forever).
"""

from __future__ import annotations

import ipaddress
import socket
import sys
import warnings
from collections.abc import Callable
from typing import Any

__all__ = ["bind_to_loopback", "restrict_replica_grpc"]

_ANY_HOSTS = ("[::]", "0.0.0.0", "")
_PATCHED = "_sharedml_listen_on"  # attribute marking our wrapper, holding the address


def _listening_on(original: Callable[[Any, str], Any], host: str) -> Callable[[Any, str], Any]:
    """``add_port_to_grpc_server`` that binds ``host`` where Ray asks for every interface."""
    inner = getattr(original, "__wrapped__", original)

    def add_port(server: Any, address: str) -> Any:
        wanted, _, port = address.rpartition(":")
        if wanted in _ANY_HOSTS:
            address = f"{host}:{port}"
        return inner(server, address)

    add_port.__wrapped__ = inner  # type: ignore[attr-defined]
    setattr(add_port, _PATCHED, host)
    return add_port


def _patch(host: str) -> bool:
    """Rewrite the address in Ray's helper and in the replica module's copy of it."""
    try:
        import ray._common.tls_utils as tls_utils
    except ImportError:  # pragma: no cover - another Ray layout: nothing to patch
        return False
    modules = [tls_utils]
    replica = sys.modules.get("ray.serve._private.replica")  # imported its own reference
    if replica is not None:
        modules.append(replica)
    patched = False
    for module in modules:
        original = getattr(module, "add_port_to_grpc_server", None)
        if original is None:
            continue
        module.add_port_to_grpc_server = _listening_on(original, host)
        patched = True
    return patched


def _chosen_host() -> str | None:
    """The address an earlier patch chose for this process's replica, if any."""
    replica = sys.modules.get("ray.serve._private.replica")
    function = getattr(replica, "add_port_to_grpc_server", None)
    host = getattr(function, _PATCHED, None)
    return host if isinstance(host, str) else None


def bind_to_loopback() -> None:
    """Ray ``worker_process_setup_hook``: bind Serve's replica gRPC servers to 127.0.0.1.

    Use: ``ray.init(runtime_env={"worker_process_setup_hook":
    "sharedml.ray.bind_to_loopback"})``; the Serve controller and replicas inherit the job's
    runtime environment. Idempotent. Only for clusters whose Serve routers do not use gRPC, or
    whose nodes are on 127.0.0.1: a router dials the node's address.
    """
    _patch("127.0.0.1")


def _bindable(host: str) -> bool:
    """Whether this host can listen on ``host`` (one of its own addresses)."""
    try:
        family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    except ValueError:
        return False
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((host, 0))
    except OSError:
        return False
    return True


def restrict_replica_grpc(host: str | None = "node") -> str | None:
    """Bind this Serve replica's internal gRPC server to one address instead of every interface.

    Call it in a replica's constructor (Serve starts that server right after it); sharedml's
    :class:`~sharedml.ray.ModelServer` does. Not thread-safe: call it once, at start-up.

    Args:
        host: ``"node"`` (default): the node's address as Ray knows it, which is what Serve's
            routers dial: 127.0.0.1 on a node started on loopback. Or an IP address of this
            host. None: leave Ray's default (every interface).

    Returns:
        The address the server will listen on (the one :func:`bind_to_loopback` chose, where
        that hook ran in this worker), or None where nothing changed: ``host`` is None, Ray has
        no such helper (another version), or this host cannot bind the address (a
        ``RuntimeWarning`` says so).
    """
    if host is None:
        return None
    chosen = _chosen_host()
    if chosen is not None:  # bind_to_loopback ran in this worker: the user's choice stands
        return chosen
    if host == "node":
        import ray.util

        host = str(ray.util.get_node_ip_address())
    if not _bindable(host):
        warnings.warn(
            f"sharedml: this replica cannot listen on {host!r} (not an address of this host), "
            "so its internal gRPC server listens on every interface, as Ray's default. Pass "
            "internal_grpc_host= an address of the host, or None to silence this.",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
    listen = f"[{host}]" if ipaddress.ip_address(host).version == 6 else host
    return host if _patch(listen) else None

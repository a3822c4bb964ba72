"""sharedml on Ray Serve: replicas that share one copy of a model's weights per node.

``pip install '.[ray]'`` in a checkout. Nothing here imports Ray until it is used
(``import sharedml`` never does), so the node and pool pieces also work in plain processes.

- :func:`deployment`: a ready Ray Serve application for one model (handle calls with numpy,
  HTTP JSON / ``.npy`` / ``.npz``, the Open Inference Protocol over HTTP, binary tensors
  included, and over gRPC), each replica's pool stats exported as Ray metrics; the same
  routes, codecs and limits as ``sharedml serve``.
- For your own deployment class: :func:`prepare_on_node` (the model prepared once per node into
  the node's local cache), :func:`create_pool` (the replica's pool over it), :class:`PoolMetrics`
  (pool stats as Ray metrics), or subclass :class:`ModelServer`.
- :class:`HttpLimits`: what a replica accepts from requests (``deployment(http_limits=...)``).
- :data:`GRPC_SERVICER`: for ``serve.start(grpc_options=...)``, so that Serve's gRPC proxy
  serves the Open Inference Protocol's ``inference.GRPCInferenceService`` to the replicas.
- :func:`restrict_replica_grpc`: a replica's internal gRPC server on the node's address only
  (what :class:`ModelServer` does); :func:`bind_to_loopback`: a Ray worker setup hook keeping
  every replica's internal gRPC server on 127.0.0.1.

Details, figures and the deployment recipes: ``docs/ray.md``.
"""

from __future__ import annotations

from sharedml.protocol._admission import HttpLimits
from sharedml.ray._loopback import bind_to_loopback, restrict_replica_grpc
from sharedml.ray._metrics import PoolMetrics
from sharedml.ray._node import NodeModel, create_pool, prepare_on_node
from sharedml.ray._server import GRPC_SERVICER, ModelServer, deployment

__all__ = [
    "GRPC_SERVICER",
    "HttpLimits",
    "ModelServer",
    "NodeModel",
    "PoolMetrics",
    "bind_to_loopback",
    "create_pool",
    "deployment",
    "prepare_on_node",
    "restrict_replica_grpc",
]

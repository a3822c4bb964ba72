"""The wire formats of sharedml's servers, and what a server admits: pure, no web framework.

Shared by ``sharedml serve`` and :mod:`sharedml.ray` (one codec, one set of limits): every
rule here is tested on bytes and arrays, without a server.

- :mod:`._admission`: :class:`HttpLimits`, the server's byte budget, bodies reserved before
  they are read.
- :mod:`._tensors`: the dtype table and the checks every codec applies to what a request
  declares before decoding it.
- One codec per wire format: :mod:`._kserve` (Open Inference Protocol over HTTP, JSON and the
  binary tensor extension), :mod:`._json` (plain JSON), :mod:`._numpy` (``.npy``/``.npz``),
  :mod:`._grpc` (the protocol's gRPC messages); :mod:`._request` picks one for an HTTP body.
- :mod:`._metadata`: server and model metadata.
"""

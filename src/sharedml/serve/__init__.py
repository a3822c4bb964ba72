"""``sharedml serve``: the Open Inference Protocol over HTTP and gRPC, one pool per model.

Also the server pieces :mod:`sharedml.ray` answers with (one codec, one set of limits):
:mod:`._http` (the HTTP routes, an ASGI app), :mod:`._models` (a served model), and the codecs
and admission of :mod:`sharedml.protocol`.
"""

"""Row independence: merge callers' requests only where no value crosses from one row to another.

A batching pool concatenates callers' requests along axis 0 and splits the outputs back by rows.
That is right only if the model computes every output row from its own input row alone. Many
graphs with a dynamic axis 0 do not: a batch statistic (``ReduceMean`` over axis 0), a
``Softmax`` over axis 0, a reversed or sliced axis 0, a ``Gather`` along it, a time-major RNN
whose axis 0 is time. :class:`RowAnalysis` proves independence before a pool merges anything, by
following where the inputs' axis 0 goes through every node of the graph and its subgraphs.

Every tensor gets a :class:`Fact`:

- ``STATIC``: depends neither on the rows nor on how many there are (weights, constants, shapes
  of other axes, which merged requests share).
- ``SIZED``: depends on the number of rows ``N`` but on no row's values (``Shape(x)``, and what
  is computed from it). It may size a tensor (``Reshape``'s shape, ``Expand``'s), where the
  rule checks what it does with ``N``; it may not enter any value a caller receives.
- ``ROWS``: one axis holds the rows (``N`` of them, or ``N`` blocks of ``fold`` entries each,
  in row order), and every slice along it depends only on its own row and on static tensors.
- ``MIXED``: anything else, with the node that made it so (a :class:`Refusal`).

A rule per operator (registered in :mod:`sharedml.rows.ops` on a line of its own, with the first
opset it covers; docs/batching.md lists them) says what its outputs are given its inputs. An
operator without a rule keeps a tensor static if all its inputs are, and refuses any input that
carries rows; a node older than its rule's first opset is refused whatever its inputs. A model
is batchable when every output is ``ROWS`` on axis 0, one entry per row.

No declared shape is trusted but the graph inputs' (requests are checked against them): not an
output's, not a ``value_info``, not a subgraph's. Every other shape is derived from the inputs
and the graph's constants, and the pool's sessions load a graph that declares nothing else
(:mod:`sharedml.pool._relax`), since ONNX Runtime folds what a graph declares into constants.

``N`` and the model's other symbolic dims are followed as polynomials (:mod:`sharedml.rows._dims`),
so ``Reshape(x, [N * seq, hidden])`` and back is proven to keep each row whole, and
``Reshape(x, [4, -1])`` is proven not to. Merged requests share every dim but ``N`` (a pool
merges only requests whose other dims are equal), so a symbolic dim other than ``N`` is a
constant here.

The modules behind it, one job each: ``_dims`` (symbolic sizes), ``_facts`` (what is known of
one tensor), ``_registry`` (which rule answers for an operator, and the view of a node a rule
gets), ``_engine`` (:class:`RowAnalysis`: the inputs, the graphs, the node loop), ``ops/`` (the
rules, one module per operator family: ``_elementwise``, ``_shape``, ``_indexing``, ``_linear``,
``_conv``, ``_norm``, ``_reduce``, ``_recurrent``, ``_control``, ``_quant``, ``_random``, ``_ml``,
``_attention``; ``_common`` holds what several share). ``__init__.pyi`` lists the public names.
"""

from sharedml import _exports

__all__, __getattr__, __dir__ = _exports.attach(__name__)

"""com.microsoft's fused attention and embedding operators: the batch on axis 0."""

from __future__ import annotations

from collections.abc import Sequence

from sharedml.rows._dims import ONE, Dim, opaque
from sharedml.rows._facts import Fact, Kind
from sharedml.rows._registry import Node, Refused, rule, summary


def _batch_first(
    n: Node,
    names: Sequence[str],
    required: Sequence[int],
    optional: Sequence[int] = (),
    *,
    past: Sequence[int] = (),
    broadcast: Sequence[int] = (),
) -> None:
    """Check that the batch inputs at ``required``/``optional``/``past`` hold the rows apart.

    These operators read such an input per batch entry (a mask of key lengths per entry, a
    cache per entry, ids per entry), and several of them tell an input's form by its length
    (``mask_index`` of ``B``, ``2B`` or ``3B + 2`` entries): the input must hold the rows one
    entry each on the batch axis (axis 0; axis 1 of the ``[2, batch, ...]`` caches at
    ``past``). A static tensor there is refused: made for some batch, it would be read entry by
    entry against merged requests' rows. Only inputs at ``broadcast``, which the operator
    broadcasts over the batch where their batch axis is 1, may be static, and only where that 1
    is proven (a shape the analysis computed).

    Args:
        n: The node.
        names: The operator's input names, by index (for the messages).
        required: Inputs that must be there.
        optional: Inputs that may be absent.
        past: Inputs with the batch on axis 1.
        broadcast: Inputs that may also be static with 1 on the batch axis.
    """
    for i in [*required, *optional, *past]:
        f = n.input(i)
        what = f"input {i} ({names[i]})" if i < len(names) else f"input {i}"
        if f is None:
            if i in required:
                raise Refused(f"has no {what}")
            continue
        axis = 1 if i in past else 0
        if f.rows:
            if f.axis != axis or f.fold != ONE:
                raise Refused(
                    f"expects the batch on axis {axis} of {what}, one entry per row, where the "
                    "rows are not"
                )
        elif f.kind is Kind.SIZED:
            raise Refused(f"takes {what} from the row count")
        elif not (
            i in broadcast and f.shape is not None and len(f.shape) > axis and f.shape[axis] == ONE
        ):
            raise Refused(
                f"reads {what} per batch entry, and it is a static tensor: one request's "
                "entries would be read against another request's rows"
            )


_ATTENTION_INPUTS = (  # noqa: SIM905 (a table: one name each, compact)
    "input weights bias mask_index past attention_bias past_sequence_length"
).split()


_MHA_INPUTS = (  # noqa: SIM905 (a table: one name each, compact)
    "query key value bias key_padding_mask attention_bias past_key past_value "
    "past_sequence_length cache_indirection"
).split()


_EMBED_INPUTS = (  # noqa: SIM905 (a table: one name each, compact)
    "input_ids segment_ids word_embedding position_embedding segment_embedding gamma beta "
    "mask position_ids"
).split()


@rule("com.microsoft", "Attention", since=1)
@summary(
    "batch on axis 0 of the input and mask (past on axis 1); static weights; a static "
    "mask or past refused"
)
def _attention(n: Node) -> list[Fact]:
    n.require_static([1, 2], "weights")
    n.require_static([6], "past sequence length")
    _batch_first(n, _ATTENTION_INPUTS, [0], [3, 5], past=[4], broadcast=[5])
    shape = n.shape(0)
    sizes = n.attr("qkv_hidden_sizes")
    hidden = Dim.of(sizes[2]) if sizes else shape[2]
    out = [n.rows([shape[0], shape[1], hidden], 0)]
    if n.outputs > 1:
        out.append(n.rows([Dim.of(2), shape[0], opaque(), opaque(), opaque()], 1))
    return out


@rule("com.microsoft", "MultiHeadAttention", since=1)
@rule("com.microsoft", "RotaryEmbedding", since=1)
@rule("com.microsoft", "GroupQueryAttention", since=1)
@summary("batch on axis 0 of every tensor input; static masks, keys and caches refused")
def _mha(n: Node) -> list[Fact]:
    if n.op == "GroupQueryAttention":
        raise Refused("is GroupQueryAttention, whose cache lengths are not analyzed")
    if n.op == "RotaryEmbedding":
        n.require_static([2, 3], "cos/sin caches")
        ids = n.input(1)
        if ids is not None and ids.kind is Kind.STATIC and ids.rank == 1:
            # one position offset for every batch entry (shape [1]): the same for any rows
            if ids.shape is None or ids.shape[0] != ONE:
                raise Refused("takes position ids of a static 1-D shape other than [1]")
        else:
            _batch_first(n, ("input", "position_ids"), [0, 1])
        return [n.like(n.need(0))]
    n.require_static([3], "bias")
    n.require_static([8], "past sequence length")
    _batch_first(n, _MHA_INPUTS, [0], [1, 2, 4, 5, 6, 7, 9], broadcast=[5])
    shape = n.shape(0)
    out = [n.rows(shape if len(shape) == 3 else [shape[0], shape[1], opaque()], 0)]
    for _ in range(1, n.outputs):
        out.append(n.rows([shape[0], opaque(), opaque(), opaque()], 0))
    return out


@rule("com.microsoft", "EmbedLayerNormalization", since=1)
@summary("ids, segment ids and mask on axis 0; static embeddings; static position ids [1, S]")
def _embed_layer_norm(n: Node) -> list[Fact]:
    n.require_static([2, 3, 4, 5, 6], "embeddings and norm parameters")
    _batch_first(n, _EMBED_INPUTS, [0], [1, 7, 8], broadcast=[8])
    shape = n.shape(0)
    out = [n.rows([shape[0], shape[1], opaque()], 0), n.rows([shape[0]], 0)]
    if n.outputs > 2:
        out.append(out[0])
    return out[: n.outputs]

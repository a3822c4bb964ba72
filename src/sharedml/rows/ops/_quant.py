"""Quantization: per-tensor or per-axis parameters only; dynamic quantization is refused."""

from __future__ import annotations

from sharedml.rows._dims import ONE, product
from sharedml.rows._facts import Fact
from sharedml.rows._registry import Node, Refused, rule, summary
from sharedml.rows.ops._common import norm_axis


@rule("", "QuantizeLinear", since=10)
@rule("", "DequantizeLinear", since=10)
@summary("per-tensor or per-axis parameters, not per row")
def _quantize(n: Node) -> Fact:
    f = n.need(0)
    n.require_static([1, 2], "scale and zero point")
    if not f.rows:
        return n.like(f)
    shape = n.shape(0)
    scale = n.need(1).shape
    if scale is None:
        raise Refused("has a scale of unknown rank")
    if len(scale) >= 1 and product(scale) != ONE:
        if len(scale) > 1 or n.attr("block_size", 0):
            raise Refused("quantizes in blocks that may span the rows' axis")
        if norm_axis(n.attr("axis", 1), len(shape)) == f.axis:
            raise Refused("pairs each row with a scale by position")
    return n.like(f)


@rule("", "DynamicQuantizeLinear", since=11)
@rule("com.microsoft", "DynamicQuantizeMatMul", since=1)
@rule("com.microsoft", "DynamicQuantizeLSTM", since=1)
@summary("refused: one quantization scale for the whole tensor, all rows together")
def _dynamic_quantize(n: Node) -> Fact:
    raise Refused("quantizes with one scale computed from the whole tensor, all rows together")

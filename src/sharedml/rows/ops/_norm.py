"""Normalizations: statistics over axes other than the rows'."""

from __future__ import annotations

from sharedml.rows._dims import ONE
from sharedml.rows._facts import Fact
from sharedml.rows._registry import Node, Refused, rule, summary
from sharedml.rows.ops._common import along, broadcast, norm_axis, normalized_from


@rule("", "BatchNormalization", since=7)  # 1/6 train unless an is_test attribute says otherwise
@summary("inference only (training computes batch statistics); rows not on the channel axis")
def _batch_norm(n: Node) -> Fact:
    f = n.need(0)
    training = n.attr("training_mode", 0) if n.opset >= 14 else 0
    if training or (n.outputs > 1 and any(n.proto.output[1:])):
        raise Refused("runs in training mode: it normalizes with statistics of the whole batch")
    n.require_static(range(1, 5), "scale, bias, mean and variance")
    if f.rows and f.axis == 1:
        raise Refused("pairs each row with a channel's statistics by position")
    return n.like(f)


@rule("", "InstanceNormalization", since=1)
@rule("", "GroupNormalization", since=18)
@summary("statistics per row: rows on axis 0")
def _instance_norm(n: Node) -> Fact:
    f = n.need(0)
    n.require_static(range(1, len(n.ins)), "scale and bias")
    if f.rows and (f.axis != 0 or f.fold != ONE):
        raise Refused("normalizes with statistics that span the rows' axis")
    return n.like(f)


@rule("", "LayerNormalization", since=17)
@rule("", "RMSNormalization", since=23)
@summary("normalizes axes after the rows'")
def _layer_norm(n: Node) -> list[Fact]:
    f = n.need(0)
    shape = n.shape(0)
    axis = norm_axis(n.attr("axis", -1), len(shape))
    normalized_from(n, f, axis)
    broadcast(n, [0, 1, 2])  # scale and bias meet the rows as in broadcasting
    y = n.like(f)
    stats = n.like(f, [*shape[:axis], *([ONE] * (len(shape) - axis))])
    return [y] + [stats] * (n.outputs - 1)


@rule("com.microsoft", "LayerNormalization", since=1)
@rule("com.microsoft", "SimplifiedLayerNormalization", since=1)
# ORT registers its RMS norm in the ONNX domain as well (what its LLM exports use).
@rule("", "SimplifiedLayerNormalization", since=1)
@summary("normalizes axes after the rows'")
def _ms_layer_norm(n: Node) -> list[Fact]:
    return _layer_norm(n)


@rule("com.microsoft", "SkipLayerNormalization", since=1)
@rule("com.microsoft", "SkipSimplifiedLayerNormalization", since=1)
@summary("adds a skip and normalizes the last axis: rows elsewhere")
def _skip_layer_norm(n: Node) -> list[Fact]:
    f = n.need(0)
    shape = n.shape(0)
    normalized_from(n, f, len(shape) - 1)
    y = broadcast(n)
    outs = [y]
    for k in range(1, n.outputs):
        outs.append(y if k == 3 else n.like(y, [*shape[:-1], ONE]))
    return outs


@rule("", "LpNormalization", since=1)
@summary("normalizes one axis: not the rows'")
def _lp_norm(n: Node) -> Fact:
    return along(n, n.attr("axis", -1), "normalizes along the rows' axis")


@rule("", "MeanVarianceNormalization", since=9)
@summary("normalizes its axes (default 0, 2, 3): not the rows'")
def _mvn(n: Node) -> Fact:
    f = n.need(0)
    shape = n.shape(0)
    axes = [norm_axis(a, len(shape)) for a in n.attr("axes", [0, 2, 3])]
    if f.rows and f.axis in axes:
        raise Refused("normalizes with statistics over the rows' axis")
    return n.like(f)

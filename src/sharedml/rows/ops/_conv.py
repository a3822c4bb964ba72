"""Convolutions, pooling and other spatial operators: the rows on axis 0, static weights."""

from __future__ import annotations

from collections.abc import Sequence

from sharedml.rows._dims import ONE, Dim, opaque
from sharedml.rows._facts import Fact
from sharedml.rows._registry import Node, Refused, rule, summary


def _window_dims(
    n: Node, spatial: Sequence[Dim], kernel: Sequence[int], transpose: bool = False
) -> list[Dim]:
    k = len(spatial)
    strides = n.attr("strides") or [1] * k
    dil = n.attr("dilations") or [1] * k
    pads = n.attr("pads") or [0] * (2 * k)
    auto = n.attr("auto_pad", "NOTSET")
    ceil = n.attr("ceil_mode", 0)
    out: list[Dim] = []
    for i, d in enumerate(spatial):
        c = d.const
        if c is None or i >= len(kernel) or kernel[i] is None:
            out.append(opaque([d]))
            continue
        kk, s, dl = kernel[i], strides[i], dil[i]
        if transpose:
            op = (n.attr("output_padding") or [0] * k)[i]
            shape = n.attr("output_shape")
            if shape:
                out.append(Dim.of(shape[i]))
            else:
                out.append(Dim.of(s * (c - 1) + op + ((kk - 1) * dl + 1) - pads[i] - pads[i + k]))
            continue
        if auto in ("SAME_UPPER", "SAME_LOWER"):
            out.append(Dim.of(-(-c // s)))
        elif auto == "VALID":
            out.append(Dim.of((c - ((kk - 1) * dl + 1)) // s + 1))
        else:
            span = c + pads[i] + pads[i + k] - ((kk - 1) * dl + 1)
            out.append(Dim.of((-(-span // s) if ceil else span // s) + 1))
    return out


def _conv_like(
    n: Node,
    x: int,
    w: int,
    static: Sequence[int],
    transpose: bool = False,
    channels_last: bool = False,
) -> Fact:
    f = n.need(x)
    shape = n.shape(x)
    n.require_static(static, "weights")
    wshape = n.need(w).shape
    if not f.rows:
        return n.plain(None)
    if f.axis != 0 or f.fold != ONE:
        raise Refused("convolves across the rows (they are not on axis 0)")
    kernel = n.attr("kernel_shape") or ([d.const for d in wshape[2:]] if wshape else [])
    spatial = shape[1:-1] if channels_last else shape[2:]
    group = n.attr("group", 1)
    if wshape is None:
        m = opaque()
    elif transpose:
        m = wshape[1] * group
    else:
        m = wshape[0]
    dims = _window_dims(n, spatial, kernel, transpose)
    out = [shape[0], *dims, m] if channels_last else [shape[0], m, *dims]
    return n.rows(out, 0)


@rule("", "Conv", since=1)
@summary("rows on axis 0; static weights")
def _conv(n: Node) -> Fact:
    return _conv_like(n, 0, 1, (1, 2))


@rule("", "ConvTranspose", since=1)
@summary("rows on axis 0; static weights")
def _conv_transpose(n: Node) -> Fact:
    return _conv_like(n, 0, 1, (1, 2), transpose=True)


@rule("", "ConvInteger", since=10)
@summary("rows on axis 0; static weights")
def _conv_integer(n: Node) -> Fact:
    return _conv_like(n, 0, 1, (1, 2, 3))


@rule("", "QLinearConv", since=10)
@summary("rows on axis 0; static weights and quantization parameters")
def _qlinear_conv(n: Node) -> Fact:
    return _conv_like(n, 0, 3, (1, 2, 3, 4, 5, 6, 7, 8))


@rule("com.microsoft", "FusedConv", since=1)
@summary("as Conv; the added Z holds the same rows")
def _fused_conv(n: Node) -> Fact:
    z = n.input(3)
    out = _conv_like(n, 0, 1, (1, 2))
    if z is not None and not (z.rows and z.axis == 0 and z.fold == ONE):
        raise Refused("adds a Z that does not hold the rows on axis 0")
    return out


@rule("com.microsoft", "NhwcConv", since=1)
@summary("as Conv, channels last")
def _nhwc_conv(n: Node) -> Fact:
    return _conv_like(n, 0, 1, (1, 2), channels_last=True)


@rule("", "AveragePool", since=1)
@rule("", "MaxPool", since=1)
@rule("", "LpPool", since=1)
@rule("", "GlobalAveragePool", since=1)
@rule("", "GlobalMaxPool", since=1)
@rule("", "GlobalLpPool", since=1)
@summary("pools spatial axes (2 and later): rows on axis 0 or 1")
def _pool(n: Node) -> list[Fact]:
    f = n.need(0)
    shape = n.shape(0)
    if f.rows and (f.axis > 1 or f.fold != ONE):
        raise Refused("pools over the rows' axis")
    if n.op.startswith("Global"):
        dims = [ONE] * (len(shape) - 2)
    else:
        dims = _window_dims(n, shape[2:], n.attr("kernel_shape") or [])
    out = n.like(f, [shape[0], shape[1], *dims])
    if n.op == "MaxPool" and n.outputs > 1 and n.proto.output[1] and f.rows:
        raise Refused(
            "returns indices counted over the whole batch (each row's depend on its position)"
        )
    return [out] + [out] * (n.outputs - 1)


@rule("com.microsoft", "QLinearAveragePool", since=1)
@rule("com.microsoft", "QLinearGlobalAveragePool", since=1)
@summary("as the pools")
def _qlinear_pool(n: Node) -> Fact:
    n.require_static(range(1, len(n.ins)), "quantization parameters")
    f = n.need(0)
    shape = n.shape(0)
    last = bool(n.attr("channels_last", 0))
    if f.rows and (f.axis != 0 or f.fold != ONE):
        raise Refused("pools over the rows' axis")
    if n.op == "QLinearGlobalAveragePool":
        dims = [ONE] * (len(shape) - 2)
    else:
        dims = _window_dims(n, shape[1:-1] if last else shape[2:], n.attr("kernel_shape") or [])
    out = [shape[0], *dims, shape[-1]] if last else [shape[0], shape[1], *dims]
    return n.like(f, out)


@rule("", "DepthToSpace", since=1)
@rule("", "SpaceToDepth", since=1)
@summary("rows on axis 0")
def _depth_space(n: Node) -> Fact:
    f = n.need(0)
    shape = n.shape(0)
    if f.rows and (f.axis != 0 or f.fold != ONE):
        raise Refused("moves entries across the rows' axis")
    b = n.attr("blocksize", 1)
    if n.op == "DepthToSpace":
        out = [shape[0], _cdiv(shape[1], b * b), shape[2] * b, shape[3] * b]
    else:
        out = [shape[0], shape[1] * (b * b), _cdiv(shape[2], b), _cdiv(shape[3], b)]
    return n.like(f, out)


def _cdiv(d: Dim, k: int) -> Dim:
    exact = d.divide(k)
    return exact if exact is not None else opaque([d])


@rule("", "GridSample", since=16)
@summary("both inputs hold the rows on axis 0")
def _grid_sample(n: Node) -> Fact:
    x, grid = n.need(0), n.need(1)
    xs, gs = n.shape(0), n.shape(1)
    out = [xs[0], xs[1], *gs[1:-1]]
    if not x.rows and not grid.rows:
        return n.plain(out)
    for f in (x, grid):
        if not (f.rows and f.axis == 0 and f.fold == ONE):
            raise Refused("samples a batch by another batch's position")
    return n.rows(out, 0)

"""sharedml.ray's HTTP layer without a cluster: bodies to feeds, outputs to bodies, routes, 4xx.

The codec (``sharedml.ray._http``) is pure; the server's routing is driven with real starlette
requests on a :class:`ModelServer` created in this process (needs the ray extra: starlette and
``ray.util.metrics``, which do nothing without a cluster).
"""

from __future__ import annotations

import asyncio
import io
import json
import math
import re
import struct
import subprocess
import sys
import threading
import time
import zipfile
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest

from sharedml.ray import _http
from sharedml.ray._http import NPY, NPZ, HttpError, parse_request


class _Arg:
    def __init__(self, name: str, type_: str, shape: list[Any]) -> None:
        self.name, self.type, self.shape = name, type_, shape


INPUTS = _http.tensor_infos(
    [
        _Arg("x", "tensor(float)", ["batch", 3]),
        _Arg("ids", "tensor(int64)", ["batch"]),
        _Arg("mask", "tensor(bool)", ["batch"]),
        _Arg("text", "tensor(string)", ["batch"]),
        _Arg("small", "tensor(int8)", ["batch"]),
    ]
)
ONE_INPUT = {"x": INPUTS["x"]}
ROOT = Path(__file__).resolve().parents[2]
JS = "application/json"


def parse_json(doc: Any, inputs: Any = INPUTS, **kwargs: Any) -> _http.InferRequest:
    return parse_request(json.dumps(doc).encode(), "application/json", inputs, **kwargs)


def refused(
    status: int,
    body: bytes,
    content_type: str = "application/json",
    inputs: Any = INPUTS,
    **kw: Any,
) -> str:
    with pytest.raises(HttpError) as info:
        parse_request(body, content_type, inputs, **kw)
    assert info.value.status == status, info.value.message
    return info.value.message


def test_tensor_infos_map_ort_types_and_dynamic_dims() -> None:
    x = INPUTS["x"]
    assert (x.dtype, x.datatype, x.shape) == (np.float32, "FP32", (-1, 3))
    assert INPUTS["text"].datatype == "BYTES"
    odd = _http.tensor_infos([_Arg("b", "tensor(bfloat16)", [None])])["b"]
    assert (odd.dtype, odd.datatype, odd.shape) == (None, None, (-1,))


def test_open_inference_protocol_request_and_reply_shapes() -> None:
    doc = {
        "id": "42",
        "inputs": [
            {"name": "x", "shape": [2, 3], "datatype": "FP32", "data": [1, 2, 3, 4.5, 5, 6]},
            {"name": "ids", "shape": [2], "datatype": "INT64", "data": [[7], [8]]},
        ],
        "outputs": [{"name": "y"}],
    }
    request = parse_json(doc)
    assert request.style == "kserve" and request.request_id == "42"
    assert request.output_names == ["y"]
    np.testing.assert_array_equal(request.feed["x"], [[1, 2, 3], [4.5, 5, 6]])
    assert request.feed["x"].dtype == np.float32 and request.feed["ids"].dtype == np.int64
    assert request.feed["ids"].shape == (2,)

    outputs = {"y": np.arange(6, dtype=np.float32).reshape(2, 3), "n": np.array([b"a", b"b"])}
    body, media = _http.encode_outputs(outputs, request, accept="", model_name="m")
    assert media == _http.JSON
    assert json.loads(body) == {
        "model_name": "m",
        "id": "42",
        "outputs": [
            {"name": "y", "shape": [2, 3], "datatype": "FP32", "data": [0, 1, 2, 3, 4, 5]},
            {"name": "n", "shape": [2], "datatype": "BYTES", "data": ["a", "b"]},
        ],
    }


def test_plain_json_converts_to_the_model_dtypes() -> None:
    request = parse_json(
        {
            "inputs": {"x": [[1, 2, 3]], "ids": [5], "mask": [True], "text": ["hi"], "small": []},
            "outputs": ["y"],
        }
    )
    assert request.style == "json" and request.output_names == ["y"]
    dtypes = {name: a.dtype for name, a in request.feed.items()}
    assert dtypes == {
        "x": np.float32,
        "ids": np.int64,
        "mask": np.bool_,
        "text": np.object_,
        "small": np.int8,
    }
    assert request.feed["small"].shape == (0,)
    body, _ = _http.encode_outputs({"y": np.ones((1, 2))}, request, accept="", model_name="m")
    assert json.loads(body) == {"model_name": "m", "outputs": {"y": [[1.0, 1.0]]}}
    # A name the model does not have is refused before its values are decoded; a missing one
    # is left to the pool (its own message, whichever way a request arrives).
    assert "unknown input(s) 'nope'" in refused(400, b'{"inputs": {"nope": [1.5]}}')
    assert sorted(parse_json({"inputs": {"ids": [1]}}).feed) == ["ids"]


@pytest.mark.parametrize(
    ("doc", "needle"),
    [
        ({"inputs": {"ids": [1.5]}}, "must hold integers"),
        ({"inputs": {"x": [[True, False, True]]}}, "must hold numbers"),
        ({"inputs": {"mask": [1]}}, "must hold true/false"),
        ({"inputs": {"text": [1]}}, "must hold strings"),
        ({"inputs": {"small": [300]}}, "outside the range"),
        ({"inputs": {"x": [[1, 2], [3]]}}, "rectangular"),
        ({"inputs": {"x": [[1, None, 3]]}}, "nulls"),
        ({"inputs": []}, "non-empty list"),
        ({"inputs": {}}, "map each input name"),
        ({"input": [1]}, 'object with "inputs"'),
        ([1, 2], 'object with "inputs"'),
        ({"inputs": {"x": [[1, 2, 3]]}, "outputs": "y"}, "must be a list"),
        ({"inputs": {"x": [[1, 2, 3]]}, "outputs": [3]}, 'must be "<output>"'),
        (
            {"inputs": [{"name": "x", "shape": [1, 3], "datatype": "FP64", "data": [1, 2, 3]}]},
            "FP32 in the model; the request sends FP64",
        ),
        (
            {"inputs": [{"name": "x", "shape": [2, 3], "datatype": "FP32", "data": [1, 2, 3]}]},
            "has 3 values, but its shape [2, 3] needs 6",
        ),
        (
            {"inputs": [{"name": "x", "shape": [-1], "datatype": "FP32", "data": [1]}]},
            "non-negative integers",
        ),
        (
            {"inputs": [{"name": "x", "shape": [1], "datatype": "FLOAT", "data": [1]}]},
            "datatype 'FLOAT' is not one of",
        ),
        ({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32"}]}, 'has no "data"'),
        ({"inputs": [{"shape": [1], "datatype": "FP32", "data": [1]}]}, 'no "name"'),
        ({"inputs": ["x"]}, "must be an object"),
        (
            {"inputs": [{"name": "ids", "shape": [1], "datatype": "INT64", "data": [1]}] * 2},
            "given twice",
        ),
        (
            {
                "inputs": [{"name": "x", "shape": [1, 3], "datatype": "FP32", "data": [1, 2, 3]}],
                "outputs": ["y"],
            },
            '{"name": "<output>"}',
        ),
    ],
)
def test_bad_json_is_a_400_naming_the_problem(doc: Any, needle: str) -> None:
    assert needle in refused(400, json.dumps(doc).encode())


def test_float16_overflow_is_refused_not_turned_into_inf() -> None:
    infos = _http.tensor_infos([_Arg("h", "tensor(float16)", ["batch"])])
    with pytest.raises(HttpError, match="too large"):
        parse_json({"inputs": {"h": [1e6]}}, infos)


def test_malformed_bodies_and_content_types() -> None:
    assert "not valid JSON" in refused(400, b"{bad")
    assert "not valid JSON" in refused(400, b"\xff\xfe")
    assert "Unsupported Content-Type 'text/plain'" in refused(415, b"x", "text/plain")
    assert "Unsupported Content-Type" in refused(415, b"garbage", "")
    assert "not a readable .npy" in refused(400, b"\x93NUMPYjunk", NPY, ONE_INPUT)
    assert "not a readable .npz" in refused(400, b"PK\x03\x04junk", NPZ)
    assert "are JSON, not npy" in refused(400, _npy(np.ones((1, 3), np.float32)), NPY, kserve=True)
    # The Open Inference Protocol path wants its shape, not the plain one.
    assert "non-empty list" in refused(400, b'{"inputs": {"x": [[1, 2, 3]]}}', kserve=True)


def _npy(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


def _npz(**arrays: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.savez_compressed(buf, **arrays)  # type: ignore[arg-type]
    return buf.getvalue()


def test_npy_and_npz_bodies_and_replies() -> None:
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    for content_type in (NPY, "application/octet-stream", ""):  # sniffed when not declared
        request = parse_request(_npy(x), content_type, ONE_INPUT, output_names=["y"])
        assert request.style == "npy" and request.output_names == ["y"]
        np.testing.assert_array_equal(request.feed["x"], x)
    assert "send an .npz" in refused(400, _npy(x), NPY)  # several inputs: which one?

    request = parse_request(_npz(x=x, ids=np.array([1, 2], np.int64)), NPZ, INPUTS)
    assert request.style == "npz" and sorted(request.feed) == ["ids", "x"]
    assert parse_request(_npz(x=x), "", INPUTS).style == "npz"
    assert "holds no arrays" in refused(400, _npz(), NPZ)
    pickled = io.BytesIO()
    np.save(pickled, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    assert "would need pickle" in refused(400, pickled.getvalue(), NPY, ONE_INPUT)  # never run

    y = {"y": x * 2}
    body, media = _http.encode_outputs(y, request, accept="", model_name="m")  # npz in, npz out
    assert media == NPZ
    with np.load(io.BytesIO(body)) as archive:
        np.testing.assert_array_equal(archive["y"], x * 2)
    for accept in ("*/*", "application/*;q=0.8", "text/html, */*"):  # any: like the request
        assert _http.encode_outputs(y, request, accept=accept, model_name="m")[1] == NPZ
    body, media = _http.encode_outputs(y, request, accept=NPY, model_name="m")
    assert media == NPY
    np.testing.assert_array_equal(np.load(io.BytesIO(body)), x * 2)
    body, media = _http.encode_outputs(
        y, request, accept="text/html, application/json", model_name="m"
    )
    assert media == _http.JSON and json.loads(body)["outputs"]["y"] == (x * 2).tolist()
    with pytest.raises(HttpError, match="pick one with") as info:
        _http.encode_outputs({"a": x, "b": x}, request, accept=NPY, model_name="m")
    assert info.value.status == 406
    with pytest.raises(HttpError) as info:
        _http.encode_outputs(y, request, accept="text/html", model_name="m")
    assert info.value.status == 406


def test_npz_that_unpacks_beyond_the_limit_is_a_413() -> None:
    body = _npz(x=np.zeros((1024 * 1024, 3), np.float32))  # 12 MiB of zeros, ~12 KiB sent
    assert len(body) < 64 * 1024
    limits = _http.HttpLimits(max_request_bytes=1 << 20, max_rows=2**20)
    assert "headers declare 12.0 MiB" in refused(413, body, NPZ, limits=limits)


# --------------------------------------------------------------------------------------------
# Bombs: bodies judged by what they declare, before anything is inflated

_MIB = 2**20


def npy_header(shape: tuple[int, ...], dtype: Any = np.float32) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        buf, {"descr": np.dtype(dtype).str, "fortran_order": False, "shape": shape}
    )
    return buf.getvalue()


def deflated_zeros(prefix: bytes, zeros: int) -> tuple[bytes, int]:
    """Raw deflate of ``prefix`` then ``zeros`` zero bytes, and its CRC-32: about 1 KiB per MiB.

    Every MiB of zeros is compressed after a full flush, so each gives the same bytes: a
    GiB-sized member is built in a fraction of a second.
    """
    compressor = zlib.compressobj(9, zlib.DEFLATED, -15)
    head = compressor.compress(prefix) + compressor.flush(zlib.Z_FULL_FLUSH)
    mib = bytes(_MIB)
    block = compressor.compress(mib) + compressor.flush(zlib.Z_FULL_FLUSH)
    crc = zlib.crc32(prefix)
    for _ in range(zeros // _MIB):
        crc = zlib.crc32(mib, crc)
    rest = bytes(zeros % _MIB)
    tail = compressor.compress(rest) + compressor.flush()
    return head + block * (zeros // _MIB) + tail, zlib.crc32(rest, crc)


def forged_npz(*members: tuple[str, bytes, int, int | None]) -> bytes:
    """A zip of deflated members ``(name, npy header, zero bytes after it, declared size)``.

    Written by hand (zipfile compresses what it is given, and honestly): ``declared`` sets the
    unpacked size the archive claims (None: the true one).
    """
    out, central = io.BytesIO(), io.BytesIO()
    for name, header, zeros, declared in members:
        data, crc = deflated_zeros(header, zeros)
        size = len(header) + zeros if declared is None else declared
        offset, encoded = out.tell(), name.encode()
        fields = (20, 0, zipfile.ZIP_DEFLATED, 0, 0x21, crc, len(data), size, len(encoded))
        out.write(struct.pack("<4s5H3L2H", b"PK\x03\x04", *fields, 0) + encoded + data)
        central.write(
            struct.pack("<4s6H3L5H2L", b"PK\x01\x02", 20, *fields, 0, 0, 0, 0, 0, offset) + encoded
        )
    count, start = len(members), out.tell()
    directory = central.getvalue()
    out.write(directory)
    out.write(struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, count, count, len(directory), start, 0))
    return out.getvalue()


@pytest.fixture
def inflated(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """``inflated[0]``: the bytes every zlib decompressor has produced since the test began."""
    total = [0]
    real = zlib.decompressobj

    class Counting:
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def decompress(self, data: bytes, max_length: int = 0) -> bytes:
            out: bytes = self.inner.decompress(data, max_length)
            total[0] += len(out)
            return out

        def flush(self, *args: Any) -> bytes:
            out: bytes = self.inner.flush(*args)
            total[0] += len(out)
            return out

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

    monkeypatch.setattr(zlib, "decompressobj", lambda *a, **k: Counting(real(*a, **k)))
    return total


BOMB_MIB = 64  # what each bomb below unpacks to; it sends about 70 KiB
ROWS = BOMB_MIB * _MIB // 12  # rows of x (3 float32 each) that take BOMB_MIB
SMALL = _http.HttpLimits(max_request_bytes=16 * _MIB, max_rows=2**24)


@pytest.mark.parametrize(
    ("member", "shape", "dtype", "limits", "status", "needle"),
    [
        ("x.npy", (ROWS // 4 * 3, 4), np.float32, SMALL, 400, "must have 3 on axis 1"),
        ("x.npy", (ROWS * 3,), np.float32, SMALL, 400, "must have rank 2"),
        ("x.npy", (ROWS // 2, 3), np.float64, SMALL, 400, "not float64"),
        ("nope.npy", (ROWS, 3), np.float32, SMALL, 400, "unknown input(s) 'nope'"),
        ("x.npy", (ROWS, 3), np.float32, SMALL, 413, "headers declare 64.0 MiB"),
        ("x.npy", (ROWS, 3), np.float32, _http.HttpLimits(), 413, f"has {ROWS} rows"),
        ("x.npy", (ROWS // 2, 3), object, SMALL, 400, "would need pickle"),
        ("x.txt", (ROWS, 3), np.float32, SMALL, 400, "not an .npy array"),
    ],
)
def test_npz_bomb_is_refused_before_anything_is_inflated(
    inflated: list[int],
    member: str,
    shape: tuple[int, ...],
    dtype: Any,
    limits: _http.HttpLimits,
    status: int,
    needle: str,
) -> None:
    zeros = math.prod(shape) * np.dtype(dtype).itemsize  # an honest archive: all it says it is
    body = forged_npz((member, npy_header(shape, dtype), zeros, None))
    assert zeros >= BOMB_MIB * _MIB - 16 and len(body) < 100 * 1024
    try:
        assert needle in refused(status, body, NPZ, limits=limits)
    finally:
        assert inflated[0] < 64 * 1024  # the npy header and zlib's first block at most


def test_npz_member_is_never_inflated_beyond_its_header(inflated: list[int]) -> None:
    header = npy_header((1, 3))  # 12 bytes of data...
    lying = forged_npz(("x.npy", header, BOMB_MIB * _MIB, None))  # ...followed by 64 MiB
    assert "its .npy header describes" in refused(400, lying, NPZ)
    assert inflated[0] < 64 * 1024
    # The zip entry agrees with the header, but its deflate stream holds 64 MiB more.
    forged = forged_npz(("x.npy", header, BOMB_MIB * _MIB, len(header) + 12))
    assert "not a readable .npy array" in refused(400, forged, NPZ)  # zipfile: bad CRC
    assert inflated[0] < 128 * 1024
    # An honest member is read whole, and only once past its header.
    inflated[0] = 0
    honest = forged_npz(("x.npy", npy_header((1024, 3)), 1024 * 12, None))
    np.testing.assert_array_equal(parse_request(honest, NPZ, INPUTS).feed["x"], np.zeros((1024, 3)))
    assert inflated[0] < 1024 * 12 + 2 * 32 * 1024


def test_npz_with_more_members_than_inputs_or_other_compression_is_refused() -> None:
    header = npy_header((1, 3))
    many = forged_npz(*[(f"x{i}.npy", header, 12, None) for i in range(6)])
    assert "holds 6 members, but the model has 5" in refused(400, many, NPZ)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_LZMA) as archive:
        archive.writestr("x.npy", _npy(np.zeros((1, 3), np.float32)))
    assert "compressed with method 14" in refused(400, buf.getvalue(), NPZ)


def test_npy_header_is_checked_before_the_array_is_made() -> None:
    four_tib = npy_header((2**40 // 12, 3))  # what a 4 TiB array of x declares
    assert f"has {2**40 // 12} rows" in refused(413, four_tib, NPY, ONE_INPUT)
    many_rows = _http.HttpLimits(max_rows=2**62)
    assert "declares 4096.0 GiB" not in refused(413, four_tib, NPY, ONE_INPUT, limits=many_rows)
    assert "header declares" in refused(413, four_tib, NPY, ONE_INPUT, limits=many_rows)
    assert "must have 3 on axis 1" in refused(400, npy_header((1, 4)) + bytes(16), NPY, ONE_INPUT)
    short = npy_header((2, 3)) + bytes(12)  # one row of two
    assert "holds 12 bytes of data, but its header declares" in refused(400, short, NPY, ONE_INPUT)
    # A good body becomes the array without a copy.
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    got = parse_request(_npy(x), NPY, ONE_INPUT).feed["x"]
    np.testing.assert_array_equal(got, x)
    fortran = parse_request(_npy(np.asfortranarray(x)), NPY, ONE_INPUT).feed["x"]
    np.testing.assert_array_equal(fortran, x)


def test_open_inference_protocol_shapes_are_checked_before_the_data() -> None:
    def v2(shape: Any, data: Any = (), datatype: str = "FP32", name: str = "x") -> bytes:
        tensor = {"name": name, "shape": shape, "datatype": datatype, "data": list(data)}
        return json.dumps({"inputs": [tensor]}).encode()

    assert "has 1000000000000000000000000000000 rows" in refused(413, v2([10**30, 3]))
    assert "must have 3 on axis 1" in refused(400, v2([1, 10**30]))
    assert "unknown input(s) 'nope'" in refused(400, v2([10**30, 3], name="nope"))
    dynamic = _http.tensor_infos([_Arg("t", "tensor(float)", ["a", "b", "c"])])
    huge = v2([2, 2**62, 0], name="t")  # zero values, but dimensions far past 64 bits
    assert "shapes declare" in refused(413, huge, inputs=dynamic)
    assert "must have rank 2" in refused(400, v2([1, 1, 3], [0, 0, 0]))
    zero_rows = parse_request(v2([0, 3]), JS, INPUTS).feed["x"]
    assert zero_rows.shape == (0, 3) and zero_rows.dtype == np.float32


def test_json_body_limits_and_deep_nesting_are_4xx() -> None:
    limits = _http.HttpLimits(max_json_bytes=1024)
    big = json.dumps({"inputs": {"x": [[0.5, 0.5, 0.5]] * 100}}).encode()
    assert f"JSON body is {len(big)} bytes" in refused(413, big, limits=limits)
    deep = b"[" * 100_000 + b"]" * 100_000
    assert "nests lists or objects too deeply" in refused(400, deep)
    for doc in (
        {"inputs": {"x": "DEEP"}},
        {"inputs": {"x": [[1, 2, 3]]}, "outputs": ["DEEP"]},
        {"inputs": [{"name": "x", "shape": "DEEP", "datatype": "FP32", "data": []}]},
        {"inputs": [{"name": "x", "shape": [0, 3], "datatype": "DEEP", "data": []}]},
        {"id": "DEEP", "inputs": [{"name": "x", "shape": [0, 3], "datatype": "FP32", "data": []}]},
    ):
        body = json.dumps(doc).replace('"DEEP"', "[" * 900 + "]" * 900).encode()
        assert refused(400, body)  # the message shows the value safely, cut short


_BOMBS_SCRIPT = """
import json, sys, threading
import numpy as np
from sharedml.ray import _http

class Arg:
    name, type, shape = "x", "tensor(float)", ["batch", 3]

inputs = _http.tensor_infos([Arg()])
kind, paths = sys.argv[1], sys.argv[2:]
bodies = [open(p, "rb").read() for p in paths]
limits = _http.HttpLimits(max_request_bytes=2**30, max_inflight_bytes=64 * 2**20, max_rows=2**30)
budget = _http.InflightBytes(limits.max_inflight_bytes)
start, parsed = threading.Barrier(len(bodies)), threading.Barrier(len(bodies))
statuses = []

def status(field):  # bytes: VmHWM, the peak RSS since the last reset; VmRSS, now
    with open("/proc/self/status") as lines:
        line = next(line for line in lines if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024

def client(body):
    start.wait()
    try:
        request = _http.parse_request(body, _http.NPZ, inputs, limits=limits, budget=budget)
        statuses.append(200)
    except _http.HttpError as exc:
        request = None
        statuses.append(exc.status)
    parsed.wait()  # every request is in flight at once: the admitted ones hold their arrays
    if request is not None:
        request.release()

with open("/proc/self/clear_refs", "w") as refs:
    refs.write("5")  # reset the peak to what the process holds now (Linux >= 4.0)
before = status("VmRSS")
threads = [threading.Thread(target=client, args=(b,)) for b in bodies]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(json.dumps({"growth": status("VmHWM") - before, "statuses": sorted(statuses)}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self peak RSS is Linux's")
def test_bombs_at_once_leave_a_fresh_replica_process_as_it_was(tmp_path: Path) -> None:
    """Four bombs of a wrong shape inflate nothing; eight good ones are held to the budget."""

    def run(kind: str, bodies: list[bytes]) -> dict[str, Any]:
        paths = []
        for i, body in enumerate(bodies):
            paths.append(tmp_path / f"{kind}{i}.npz")
            paths[-1].write_bytes(body)
        done = subprocess.run(
            [sys.executable, "-c", _BOMBS_SCRIPT, kind, *map(str, paths)],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        return dict(json.loads(done.stdout))

    rows = 128 * _MIB // 16  # 128 MiB each: 4 float32 per row where the model takes 3
    wrong = forged_npz(("x.npy", npy_header((rows, 4)), rows * 16, None))
    bombs = run("wrong", [wrong] * 4)
    assert bombs["growth"] < 16 * _MIB, bombs  # 512 MiB asked for
    assert bombs["statuses"] == [400] * 4
    rows = 24 * _MIB // 12  # 24 MiB each, the right shape: at most two fit in 64 MiB
    good = forged_npz(("x.npy", npy_header((rows, 3)), rows * 12, None))
    held = run("good", [good] * 8)
    assert held["growth"] < (2 * 24 + 16) * _MIB, held  # 192 MiB asked for
    admitted = held["statuses"].count(200)
    assert 1 <= admitted <= 2 and held["statuses"].count(429) == 8 - admitted, held
    assert held["growth"] < (admitted * 24 + 16) * _MIB, held


def test_budget_counts_the_requests_in_flight() -> None:
    x = _npy(np.zeros((1000, 3), np.float32))  # 12,128 bytes with its header
    budget = _http.InflightBytes(30_000)
    first = parse_request(x, NPY, ONE_INPUT, budget=budget)
    second = parse_request(x, NPY, ONE_INPUT, budget=budget)
    assert budget.used_bytes == 2 * len(x)
    with pytest.raises(HttpError, match="already take") as info:
        parse_request(x, NPY, ONE_INPUT, budget=budget)
    assert info.value.status == 429 and info.value.headers == {"Retry-After": "1"}
    first.release()
    first.release()  # idempotent
    third = parse_request(x, NPY, ONE_INPUT, budget=budget)
    assert budget.used_bytes == 2 * len(x)
    # A request that could never fit is a 413, not a 429 to retry forever.
    alone = _npy(np.zeros((3000, 3), np.float32))
    assert "more than this replica's" in refused(413, alone, NPY, ONE_INPUT, budget=budget)
    # JSON reserves its parse, then only its body and arrays; npz its body and its arrays.
    doc = json.dumps({"inputs": {"x": [[0.5, 0.5, 0.5]] * 10}}).encode()
    with pytest.raises(HttpError) as info:
        parse_request(doc, JS, INPUTS, budget=_http.InflightBytes(len(doc) * 20))
    assert info.value.status == 413  # the parse alone needs 41x the body
    roomy = _http.InflightBytes(len(doc) * 41)
    parsed = parse_request(doc, JS, INPUTS, budget=roomy)
    assert roomy.used_bytes == len(doc) + 10 * 3 * 4
    npz = _npz(x=np.zeros((10, 3), np.float32))
    archived = parse_request(npz, NPZ, INPUTS, budget=roomy)
    assert roomy.used_bytes == len(doc) + 120 + len(npz) + 120
    for request in (second, third, parsed, archived):
        request.release()
    assert budget.used_bytes == 0 and roomy.used_bytes == 0
    with pytest.raises(ValueError, match="max_rows must be a positive integer"):
        _http.HttpLimits(max_rows=0)


def test_nan_and_infinities_make_valid_json() -> None:
    y = np.array([[np.nan, np.inf], [-np.inf, 1.5]], np.float32)

    def strict(body: bytes) -> Any:
        def refuse(token: str) -> Any:
            raise AssertionError(f"invalid JSON token {token}")

        return json.loads(body, parse_constant=refuse)

    request = parse_json(
        {"inputs": [{"name": "x", "shape": [0, 3], "datatype": "FP32", "data": []}]}
    )
    doc = strict(_http.encode_outputs({"y": y}, request, accept="", model_name="m")[0])
    assert doc["outputs"][0]["data"] == ["NaN", "Infinity", "-Infinity", 1.5]
    # ...which numpy, hence tritonclient's as_numpy, reads back as the same values.
    back = np.asarray(doc["outputs"][0]["data"], np.float32).reshape(2, 2)
    np.testing.assert_array_equal(back, y)
    plain = parse_json({"inputs": {"x": [[1, 2, 3]]}})
    doc = strict(_http.encode_outputs({"y": y}, plain, accept="", model_name="m")[0])
    assert doc["outputs"]["y"] == [["NaN", "Infinity"], ["-Infinity", 1.5]]


def test_npz_replies_take_any_output_name_and_strings_without_pickle() -> None:
    request = parse_request(_npz(x=np.zeros((1, 3), np.float32)), NPZ, INPUTS)
    outputs = {
        "file": np.ones(2, np.float32),  # np.savez's own first parameter
        "allow_pickle": np.zeros(1),
        "names": np.array(["a", "bé"], dtype=object),  # ORT's string outputs
    }
    body, media = _http.encode_outputs(outputs, request, accept="", model_name="m")
    assert media == NPZ
    with np.load(io.BytesIO(body), allow_pickle=False) as archive:
        assert archive.files == ["file", "allow_pickle", "names"]
        np.testing.assert_array_equal(archive["file"], outputs["file"])
        assert archive["names"].tolist() == ["a", "bé"]
    one = {"names": outputs["names"]}
    body, _ = _http.encode_outputs(one, request, accept=NPY, model_name="m")
    assert np.load(io.BytesIO(body), allow_pickle=False).tolist() == ["a", "bé"]


# --------------------------------------------------------------------------------------------
# The server's routes, in this process (no cluster)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    pytest.importorskip("ray.util.metrics", reason="the ray extra is not installed")
    pytest.importorskip("starlette", reason="the ray extra is not installed")
    from sharedml.ray import ModelServer
    from tools.realistic_models import mlp

    folder = tmp_path_factory.mktemp("server")
    info = mlp(folder / "tiny.onnx", size="tiny")
    server = ModelServer(info.path, sessions=2, cache_dir=folder / "cache")
    yield server
    server.pool.close()


def call(server: Any, method: str, path: str, body: bytes = b"", **headers: str) -> Any:
    """One request through ``server.__call__`` as Serve delivers it (root_path = the prefix)."""
    return asyncio.run(server(starlette_request(method, path, body, **headers)))


def starlette_request(method: str, path: str, body: bytes = b"", **headers: str) -> Any:
    """A starlette request as Serve hands it to the replica."""
    from starlette.requests import Request

    path, _, query = path.partition("?")
    scope = {
        "type": "http",
        "method": method,
        "root_path": "/app",
        "path": "/app" + path,
        "query_string": query.encode(),
        "headers": [(k.replace("_", "-").encode(), v.encode()) for k, v in headers.items()],
    }
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        more, sent = sent, True
        return {"type": "http.request", "body": b"" if more else body, "more_body": False}

    return Request(scope, receive)


def reference(path: Path, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return np.asarray(session.run(None, {"input": x})[0])


def test_server_routes_and_formats(server: Any) -> None:
    x = np.random.default_rng(0).standard_normal((2, 256)).astype(np.float32)
    expected = reference(Path(server.node.source), x)
    kserve = {
        "inputs": [
            {"name": "input", "shape": [2, 256], "datatype": "FP32", "data": x.ravel().tolist()}
        ]
    }
    for path in ("/", "/v2/models/tiny/infer", "/v2/models/tiny/versions/1/infer"):
        reply = call(
            server, "POST", path, json.dumps(kserve).encode(), content_type="application/json"
        )
        assert reply.status_code == 200, reply.body
        out = json.loads(reply.body)["outputs"][0]
        assert out["name"] == "output" and out["shape"] == [2, 256]
        np.testing.assert_allclose(
            np.reshape(out["data"], (2, 256)), expected, rtol=1e-4, atol=1e-5
        )
    plain = {"inputs": {"input": x.tolist()}}
    reply = call(server, "POST", "/", json.dumps(plain).encode(), content_type="application/json")
    np.testing.assert_allclose(
        json.loads(reply.body)["outputs"]["output"], expected, rtol=1e-4, atol=1e-5
    )
    reply = call(server, "POST", "/?output=output", _npy(x), content_type=NPY)
    assert reply.status_code == 200 and reply.media_type == NPY
    np.testing.assert_allclose(np.load(io.BytesIO(reply.body)), expected, rtol=1e-4, atol=1e-5)

    meta = json.loads(call(server, "GET", "/v2/models/tiny").body)
    assert meta["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 256]}]
    assert call(server, "GET", "/v2/models/tiny/ready").status_code == 200
    assert call(server, "GET", "/v2/health/live").status_code == 200
    assert call(server, "GET", "/v2/health/ready").status_code == 200

    handle_out = asyncio.run(server({"input": x}))
    np.testing.assert_allclose(handle_out["output"], expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "needle"),
    [
        ("POST", "/", b"{oops", 400, "not valid JSON"),
        ("POST", "/", b'{"inputs": {"inputx": [[1.0]]}}', 400, "unknown input(s) 'inputx'"),
        ("POST", "/", b'{"inputs": {"input": [[1.0, 2.0]]}}', 400, "must have 256 on axis 1"),
        ("POST", "/", b'{"inputs": {"input": [1.0]}}', 400, "must have rank 2"),
        (
            "POST",
            "/v2/models/tiny/infer",
            b'{"inputs": [{"name": "input", "shape": [1, 256], "datatype": "INT32", "data": '
            + json.dumps([1] * 256).encode()
            + b"}]}",
            400,
            "FP32 in the model",
        ),
        ("POST", "/v2/models/other/infer", b"{}", 404, "'other' is not served here"),
        ("POST", "/nowhere", b"{}", 404, "No route '/nowhere'"),
        ("GET", "/v2/models/tiny/infer", b"", 405, "Use POST"),
        ("GET", "/", b"", 405, "Use POST"),
        ("POST", "/v2/health/live", b"", 405, "Use GET"),
    ],
)
def test_server_refuses_bad_requests_with_4xx(
    server: Any, method: str, path: str, body: bytes, status: int, needle: str
) -> None:
    before = server.pool.stats()
    reply = call(server, method, path, body, content_type="application/json")
    assert reply.status_code == status, reply.body
    assert needle in json.loads(reply.body)["error"]
    after = server.pool.stats()
    assert (after.sessions, after.replaced, after.busy) == (before.sessions, 0, 0)


def test_bodies_are_parsed_off_the_event_loop(server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """While a body is being parsed, the replica's event loop (and Serve's health check) runs."""
    parsing, checked = threading.Event(), threading.Event()
    waited: list[bool] = []
    real_loads = json.loads

    def slow_loads(*args: Any, **kwargs: Any) -> Any:
        parsing.set()
        # Parsed on the event loop, this would wait in vain: the health check could not run.
        waited.append(checked.wait(timeout=10))
        return real_loads(*args, **kwargs)

    monkeypatch.setattr(json, "loads", slow_loads)
    body = json.dumps({"inputs": {"input": [[0.5] * 256]}}).encode()

    async def main() -> Any:
        reply = asyncio.ensure_future(server(starlette_request("POST", "/", body)))
        deadline = time.monotonic() + 10
        while not parsing.is_set() and time.monotonic() < deadline:
            await asyncio.sleep(0.001)
        server.check_health()  # what Serve runs on the replica's loop
        checked.set()
        return await reply

    reply = asyncio.run(main())
    assert reply.status_code == 200, reply.body
    assert waited == [True]


def test_zero_row_requests_pass_through(server: Any) -> None:
    empty = np.zeros((0, 256), np.float32)
    kserve = {"inputs": [{"name": "input", "shape": [0, 256], "datatype": "FP32", "data": []}]}
    reply = call(
        server, "POST", "/v2/models/tiny/infer", json.dumps(kserve).encode(), content_type=JS
    )
    assert reply.status_code == 200, reply.body
    assert json.loads(reply.body)["outputs"][0]["shape"] == [0, 256]
    reply = call(server, "POST", "/", _npy(empty), content_type=NPY)
    assert reply.status_code == 200, reply.body
    assert np.load(io.BytesIO(reply.body)).shape == (0, 256)
    reply = call(server, "POST", "/", _npz(input=empty), content_type=NPZ)
    assert reply.status_code == 200, reply.body
    with np.load(io.BytesIO(reply.body)) as archive:
        assert archive["output"].shape == (0, 256)
    assert server.inflight.used_bytes == 0


def test_server_refuses_what_its_limits_do_not_allow(tmp_path: Path) -> None:
    pytest.importorskip("ray.util.metrics", reason="the ray extra is not installed")
    from sharedml.ray import HttpLimits, ModelServer
    from tools.realistic_models import mlp

    path = mlp(tmp_path / "tiny.onnx", size="tiny").path
    limits = HttpLimits(max_request_bytes=64 * 1024, max_inflight_bytes=256 * 1024)
    server = ModelServer(path, sessions=1, cache_dir=tmp_path / "cache", http_limits=limits)
    try:
        x = _npy(np.ones((8, 256), np.float32))  # 8 KiB
        assert call(server, "POST", "/", x, content_type=NPY).status_code == 200
        big = _npy(np.ones((80, 256), np.float32))  # 80 KiB
        reply = call(server, "POST", "/", big, content_type=NPY)
        assert reply.status_code == 413 and "64 KiB" not in json.loads(reply.body)["error"]
        reply = call(server, "POST", "/", big, content_type=NPY, content_length=str(len(big)))
        assert reply.status_code == 413 and "bytes or more" in json.loads(reply.body)["error"]
        held = server.inflight.reserve(250 * 1024)  # the requests in flight take the budget
        reply = call(server, "POST", "/", x, content_type=NPY)
        assert reply.status_code == 429 and reply.headers["retry-after"] == "1"
        held.release()
        assert call(server, "POST", "/", x, content_type=NPY).status_code == 200
        assert server.inflight.used_bytes == 0  # every request gave its bytes back
    finally:
        server.pool.close()


def _gather_reshape_model(path: Path) -> Path:
    """``out = Reshape(Gather(table[4, 3], ids), shape)``: ORT refuses bad ids (InvalidArgument)
    and fails a Reshape to the wrong size (Fail)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    table = numpy_helper.from_array(np.arange(12, dtype=np.float32).reshape(4, 3), "table")
    graph = helper.make_graph(
        [
            helper.make_node("Gather", ["table", "ids"], ["rows"]),
            helper.make_node("Reshape", ["rows", "shape"], ["out"]),
        ],
        "gather_reshape",
        [
            helper.make_tensor_value_info("ids", TensorProto.INT64, ["n"]),
            helper.make_tensor_value_info("shape", TensorProto.INT64, [2]),
        ],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)],
        initializer=[table],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def documented_statuses() -> dict[int, str]:
    """docs/ray.md's table of HTTP statuses: status -> its "when" text."""
    text = (ROOT / "docs" / "ray.md").read_text()
    table = text[text.index("| status | when |") :].split("\n\n")[0]
    rows = [line.split("|") for line in table.splitlines()[2:]]
    return {int(row[1]): row[2] for row in rows}


def test_the_documented_status_table_is_what_the_server_answers(tmp_path: Path) -> None:
    pytest.importorskip("ray.util.metrics", reason="the ray extra is not installed")
    from sharedml.ray import HttpLimits, ModelServer

    path = _gather_reshape_model(tmp_path / "gather.onnx")
    limits = HttpLimits(max_request_bytes=1024, max_inflight_bytes=64 * 1024)
    server = ModelServer(path, sessions=1, cache_dir=tmp_path / "cache", http_limits=limits)

    def infer(ids: list[int], shape: list[int], **headers: str) -> Any:
        doc = {"inputs": {"ids": ids, "shape": shape}}
        return call(server, "POST", "/", json.dumps(doc).encode(), content_type=JS, **headers)

    def held() -> Any:
        hold = server.inflight.reserve(server.inflight.limit_bytes)
        try:
            return infer([1], [1, 3])
        finally:
            hold.release()

    assert infer([1, 2], [2, 3]).status_code == 200
    # (status, a request that gets it, words its row of the table must hold)
    cases = [
        (400, lambda: call(server, "POST", "/", b"{bad", content_type=JS), "malformed"),
        (400, lambda: infer([9], [1, 3]), "InvalidArgument"),  # ORT: index out of range
        (400, lambda: infer([1.5], [1, 3]), "losslessly"),
        (404, lambda: call(server, "GET", "/nowhere"), "unknown path"),
        (405, lambda: call(server, "GET", "/"), "method"),
        (406, lambda: infer([1], [1, 3], accept="text/html"), "Accept"),
        (413, lambda: infer([0] * 200, [200, 3]), "max_request_bytes"),
        (415, lambda: call(server, "POST", "/", b"x", content_type="text/plain"), "content type"),
        (429, held, "max_inflight_bytes"),
        (500, lambda: infer([1], [2, 3]), "RunError"),  # ORT: Reshape to the wrong size
    ]
    table = documented_statuses()
    answered = set()
    for status, request, words in cases:
        reply = request()
        assert reply.status_code == status, (status, words, reply.body)
        assert words in table.get(status, ""), (status, words, table.get(status))
        answered.add(status)
    server.pool.close()
    reply = infer([1], [1, 3])
    assert reply.status_code == 503 and "shutting down" in table[503]
    assert set(table) == answered | {503}


def test_server_handle_calls_raise_invalid_input(server: Any) -> None:
    import sharedml

    with pytest.raises(sharedml.InvalidInputError, match="unknown input"):
        asyncio.run(server({"nope": np.ones((1, 256), np.float32)}))
    with pytest.raises(sharedml.InvalidInputError, match="must be tensor\\(float\\)"):
        asyncio.run(server.infer({"input": np.ones((1, 256), np.float64)}))
    with pytest.raises(sharedml.InvalidInputError, match="takes a feed"):
        asyncio.run(server(np.ones((1, 256), np.float32)))
    assert server.info()["node_model"]["path"].endswith("model.onnx")


def test_a_model_given_as_bytes_and_a_closed_pool(tmp_path: Path) -> None:
    pytest.importorskip("ray.util.metrics", reason="the ray extra is not installed")
    import sharedml
    from sharedml.ray import ModelServer
    from tools.realistic_models import mlp

    data = Path(mlp(tmp_path / "tiny.onnx", size="tiny").path).read_bytes()
    server = ModelServer(data, sessions=1, cache_dir=tmp_path / "cache")
    assert server.model_name == "model" and server.node.source == "<model bytes>"
    assert call(server, "GET", "/v2/models/model").status_code == 200
    server.check_health()
    server.pool.close()
    with pytest.raises(sharedml.PoolClosedError):
        server.check_health()  # Serve replaces a replica whose pool is closed
    good = json.dumps({"inputs": {"input": [[0.0] * 256]}}).encode()
    reply = call(server, "POST", "/", good, content_type=JS)
    assert reply.status_code == 503 and "closed" in json.loads(reply.body)["error"]


def test_deployment_lets_enough_requests_reach_each_pool(tmp_path: Path) -> None:
    pytest.importorskip("ray.serve", reason="the ray extra is not installed")
    import sharedml
    import sharedml.ray
    from sharedml.ray import deployment

    model = tmp_path / "m.onnx"  # binding reads nothing: each replica opens the model
    app = deployment(model, sessions=3, batching=sharedml.Batching(max_batch_size=4))
    bound = app._bound_deployment  # Ray has no public accessor for a bound application's options
    assert bound.name == "sharedml-m"
    assert bound.max_ongoing_requests == 3 * (4 + 1)  # Serve's default (5) would cap batches
    assert bound.init_args == (str(model),)
    assert bound.init_kwargs["sessions"] == 3 and bound.init_kwargs["pool_options"] == {}
    # Each replica's gRPC server on the node's address, and the default HTTP limits.
    assert bound.init_kwargs["internal_grpc_host"] == "node"
    assert bound.init_kwargs["http_limits"] is None
    limits = sharedml.ray.HttpLimits(max_rows=8)
    assert (
        deployment(model, http_limits=limits)._bound_deployment.init_kwargs["http_limits"] == limits
    )
    assert deployment(model, sessions=2, batching=False)._bound_deployment.max_ongoing_requests == 4
    assert deployment(model)._bound_deployment.max_ongoing_requests == 4 * (32 + 1)
    custom = deployment(model, name="x", max_ongoing_requests=7, num_replicas=3)._bound_deployment
    assert (custom.name, custom.max_ongoing_requests, custom.num_replicas) == ("x", 7, 3)
    # sessions="auto": up to a session per CPU of the replica, at least the default count.
    auto = deployment(model, sessions="auto", ray_actor_options={"num_cpus": 8})._bound_deployment
    assert auto.init_kwargs["sessions"] == "auto"
    assert auto.max_ongoing_requests == 8 * (32 + 1)
    assert deployment(model, sessions="auto")._bound_deployment.max_ongoing_requests == 4 * 33
    with pytest.raises(TypeError):
        deployment(model, no_such_serve_option=1)


# --------------------------------------------------------------------------------------------
# What the docs tell users to type


def test_install_lines_name_the_checkout_not_an_index() -> None:
    """sharedml is on no package index: ``pip install "sharedml[ray]"`` fails."""
    for path in (
        ROOT / "README.md",
        ROOT / "docs" / "ray.md",
        ROOT / "src/sharedml/ray/__init__.py",
    ):
        lines = re.findall(r"pip install [^\n`]*", path.read_text())
        assert lines, path
        assert [line for line in lines if "sharedml[" in line] == [], path
    assert "pip install '.[ray]'" in (ROOT / "docs" / "ray.md").read_text()


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def _recipes() -> list[tuple[str, str]]:
    ray_md = (ROOT / "docs" / "ray.md").read_text()
    readme = (ROOT / "README.md").read_text()
    one_node = ray_md[ray_md.index("### One node") :]
    ray_section = readme[readme.index("## Ray Serve") :]
    return [
        ("docs/ray.md, top", _python_blocks(ray_md)[0]),
        ("docs/ray.md, One node", _python_blocks(one_node)[0]),
        (
            "README.md, Ray Serve (one node: ray.init(), then these lines)",
            _python_blocks(ray_section)[0],
        ),
    ]


@pytest.mark.parametrize(("where", "code"), _recipes(), ids=lambda v: v if " " not in v else None)
def test_one_node_recipes_fit_a_two_cpu_node(
    where: str, code: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ray places a replica only where its CPUs are free: on 2 CPUs, 4 x 1 never starts."""
    from unittest import mock

    ray = pytest.importorskip("ray", reason="the ray extra is not installed")
    serve = pytest.importorskip("ray.serve", reason="the ray extra is not installed")
    apps: list[Any] = []
    monkeypatch.setattr(ray, "init", lambda *args, **kwargs: None)
    monkeypatch.setattr(serve, "run", lambda app, **kwargs: apps.append(app) or mock.MagicMock())
    exec(compile(code, where, "exec"), {"batch": np.zeros((1, 4), np.float32)})
    (app,) = apps
    bound = app._bound_deployment  # Ray has no public accessor for a bound application's options
    cpus = bound.ray_actor_options.get("num_cpus", 1)  # Serve gives a replica 1 CPU by default
    per_node = bound._replica_config.max_replicas_per_node or bound.num_replicas
    assert bound.num_replicas * cpus <= 2, (where, bound.num_replicas, cpus)
    assert per_node >= bound.num_replicas, (where, per_node)  # all of them on the one node

"""The HTTP codecs without a server: bodies to feeds, outputs to bodies, limits, 4xx.

``sharedml.protocol`` is pure (bytes and arrays in, arrays and bytes out), shared by
``sharedml serve`` and ``sharedml.ray``; every rule is tested here on bytes.
"""

from __future__ import annotations

import io
import json
import math
import struct
import subprocess
import sys
import zipfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sharedml.protocol import _request, _tensors
from sharedml.protocol._admission import HttpLimits, InflightBytes, Reservation
from sharedml.protocol._numpy import NPY, NPZ
from sharedml.protocol._tensors import RequestError


class _Arg:
    def __init__(self, name: str, type_: str, shape: list[Any]) -> None:
        self.name, self.type, self.shape = name, type_, shape


INPUTS = _tensors.tensor_infos(
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


def parse_request(
    body: bytes,
    content_type: str,
    inputs: Any,
    *,
    budget: InflightBytes | None = None,
    **kwargs: Any,
) -> _request.InferRequest:
    """What a server does: the body's bytes reserved (as read_body does), then parsed."""
    held = budget.reserve(len(body), "The body") if budget else Reservation(None, len(body))
    return _request.parse_request(body, content_type, inputs, reservation=held, **kwargs)


def encode(outputs: Any, request: Any, accept: str = "") -> tuple[bytes, str]:
    reply = _request.encode_outputs(outputs, request, accept=accept, model_name="m")
    return reply.body(), reply.media


def parse_json(doc: Any, inputs: Any = INPUTS, **kwargs: Any) -> _request.InferRequest:
    return parse_request(json.dumps(doc).encode(), "application/json", inputs, **kwargs)


def refused(
    status: int,
    body: bytes,
    content_type: str = "application/json",
    inputs: Any = INPUTS,
    **kw: Any,
) -> str:
    with pytest.raises(RequestError) as info:
        parse_request(body, content_type, inputs, **kw)
    assert info.value.status == status, info.value.message
    return info.value.message


def test_tensor_infos_map_ort_types_and_dynamic_dims() -> None:
    x = INPUTS["x"]
    assert (x.dtype, x.datatype, x.shape) == (np.float32, "FP32", (-1, 3))
    assert INPUTS["text"].datatype == "BYTES"
    odd = _tensors.tensor_infos([_Arg("b", "tensor(bfloat16)", [None])])["b"]
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
    body, media = encode(outputs, request, "")
    assert media == _request.JSON
    assert json.loads(body) == {
        "model_name": "m",
        "model_version": "1",
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
    body, _ = encode({"y": np.ones((1, 2))}, request)
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
        ({"inputs": [{"name": "x", "shape": [1, 3], "datatype": "FP32"}]}, 'has no "data"'),
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
    infos = _tensors.tensor_infos([_Arg("h", "tensor(float16)", ["batch"])])
    with pytest.raises(RequestError, match="too large"):
        parse_json({"inputs": {"h": [1e6]}}, infos)


def test_malformed_bodies_and_content_types() -> None:
    assert "not valid JSON" in refused(400, b"{bad")
    assert "not valid JSON" in refused(400, b"\xff\xfe")
    assert "Unsupported Content-Type 'text/plain'" in refused(415, b"x", "text/plain")
    assert "Unsupported Content-Type" in refused(415, b"garbage", "")
    assert "not a readable .npy" in refused(400, b"\x93NUMPYjunk", NPY, ONE_INPUT)
    assert "not a readable .npz" in refused(400, b"PK\x03\x04junk", NPZ)
    assert "not npy bodies" in refused(400, _npy(np.ones((1, 3), np.float32)), NPY, kserve=True)
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
    body, media = encode(y, request, "")  # npz in, npz out
    assert media == NPZ
    with np.load(io.BytesIO(body)) as archive:
        np.testing.assert_array_equal(archive["y"], x * 2)
    for accept in ("*/*", "application/*;q=0.8", "text/html, */*"):  # any: like the request
        assert encode(y, request, accept)[1] == NPZ
    body, media = encode(y, request, NPY)
    assert media == NPY
    np.testing.assert_array_equal(np.load(io.BytesIO(body)), x * 2)
    body, media = encode(y, request, "text/html, application/json")
    assert media == _request.JSON and json.loads(body)["outputs"]["y"] == (x * 2).tolist()
    with pytest.raises(RequestError, match="pick one with") as info:
        encode({"a": x, "b": x}, request, NPY)
    assert info.value.status == 406
    with pytest.raises(RequestError) as info:
        encode(y, request, "text/html")
    assert info.value.status == 406


def test_npz_that_unpacks_beyond_the_limit_is_a_413() -> None:
    body = _npz(x=np.zeros((1024 * 1024, 3), np.float32))  # 12 MiB of zeros, ~12 KiB sent
    assert len(body) < 64 * 1024
    limits = HttpLimits(max_request_bytes=1 << 20, max_rows=2**20)
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
SMALL = HttpLimits(max_request_bytes=16 * _MIB, max_rows=2**24)


@pytest.mark.parametrize(
    ("member", "shape", "dtype", "limits", "status", "needle"),
    [
        ("x.npy", (ROWS // 4 * 3, 4), np.float32, SMALL, 400, "must have 3 on axis 1"),
        ("x.npy", (ROWS * 3,), np.float32, SMALL, 400, "must have rank 2"),
        ("x.npy", (ROWS // 2, 3), np.float64, SMALL, 400, "not float64"),
        ("nope.npy", (ROWS, 3), np.float32, SMALL, 400, "unknown input(s) 'nope'"),
        ("x.npy", (ROWS, 3), np.float32, SMALL, 413, "headers declare 64.0 MiB"),
        ("x.npy", (ROWS, 3), np.float32, HttpLimits(), 413, f"has {ROWS} rows"),
        ("x.npy", (ROWS // 2, 3), object, SMALL, 400, "would need pickle"),
        ("x.txt", (ROWS, 3), np.float32, SMALL, 400, "not an .npy array"),
    ],
)
def test_npz_bomb_is_refused_before_anything_is_inflated(
    inflated: list[int],
    member: str,
    shape: tuple[int, ...],
    dtype: Any,
    limits: HttpLimits,
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
    many_rows = HttpLimits(max_rows=2**62)
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
    dynamic = _tensors.tensor_infos([_Arg("t", "tensor(float)", ["a", "b", "c"])])
    huge = v2([2, 2**62, 0], name="t")  # zero values, but dimensions far past 64 bits
    assert "shapes declare" in refused(413, huge, inputs=dynamic)
    assert "must have rank 2" in refused(400, v2([1, 1, 3], [0, 0, 0]))
    zero_rows = parse_request(v2([0, 3]), JS, INPUTS).feed["x"]
    assert zero_rows.shape == (0, 3) and zero_rows.dtype == np.float32


def test_json_body_limits_and_deep_nesting_are_4xx() -> None:
    limits = HttpLimits(max_json_bytes=1024)
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
from sharedml.protocol import _request, _tensors
from sharedml.protocol._admission import HttpLimits, InflightBytes

class Arg:
    name, type, shape = "x", "tensor(float)", ["batch", 3]

inputs = _tensors.tensor_infos([Arg()])
kind, paths = sys.argv[1], sys.argv[2:]
bodies = [open(p, "rb").read() for p in paths]
limits = HttpLimits(max_request_bytes=2**30, max_inflight_bytes=64 * 2**20, max_rows=2**30)
budget = InflightBytes(limits.max_inflight_bytes)
start, parsed = threading.Barrier(len(bodies)), threading.Barrier(len(bodies))
statuses = []

def status(field):  # bytes: VmHWM, the peak RSS since the last reset; VmRSS, now
    with open("/proc/self/status") as lines:
        line = next(line for line in lines if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024

def client(body):
    start.wait()
    try:
        held = budget.reserve(len(body))
        request = _request.parse_request(
            body, "application/x-npz", inputs, limits=limits, reservation=held
        )
        statuses.append(200)
    except _tensors.RequestError as exc:
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
    budget = InflightBytes(30_000)
    first = parse_request(x, NPY, ONE_INPUT, budget=budget)
    second = parse_request(x, NPY, ONE_INPUT, budget=budget)
    assert budget.used_bytes == 2 * len(x)
    with pytest.raises(RequestError, match="already take") as info:
        parse_request(x, NPY, ONE_INPUT, budget=budget)
    assert info.value.status == 429 and info.value.headers == {"Retry-After": "1"}
    first.release()
    first.release()  # idempotent
    third = parse_request(x, NPY, ONE_INPUT, budget=budget)
    assert budget.used_bytes == 2 * len(x)
    # A request that could never fit is a 413, not a 429 to retry forever.
    alone = _npy(np.zeros((3000, 3), np.float32))
    assert "more than this server's" in refused(413, alone, NPY, ONE_INPUT, budget=budget)
    # JSON reserves its parse, then only its body and arrays; npz its body and its arrays.
    doc = json.dumps({"inputs": {"x": [[0.5, 0.5, 0.5]] * 10}}).encode()
    with pytest.raises(RequestError) as info:
        parse_request(doc, JS, INPUTS, budget=InflightBytes(len(doc) * 20))
    assert info.value.status == 413  # the parse alone needs 41x the body
    roomy = InflightBytes(len(doc) * 41)
    parsed = parse_request(doc, JS, INPUTS, budget=roomy)
    assert roomy.used_bytes == len(doc) + 10 * 3 * 4
    npz = _npz(x=np.zeros((10, 3), np.float32))
    archived = parse_request(npz, NPZ, INPUTS, budget=roomy)
    assert roomy.used_bytes == len(doc) + 120 + len(npz) + 120
    for request in (second, third, parsed, archived):
        request.release()
    assert budget.used_bytes == 0 and roomy.used_bytes == 0
    with pytest.raises(ValueError, match="max_rows must be a positive integer"):
        HttpLimits(max_rows=0)


def test_nan_and_infinities_make_valid_json() -> None:
    y = np.array([[np.nan, np.inf], [-np.inf, 1.5]], np.float32)

    def strict(body: bytes) -> Any:
        def refuse(token: str) -> Any:
            raise AssertionError(f"invalid JSON token {token}")

        return json.loads(body, parse_constant=refuse)

    request = parse_json(
        {"inputs": [{"name": "x", "shape": [0, 3], "datatype": "FP32", "data": []}]}
    )
    doc = strict(encode({"y": y}, request, "")[0])
    assert doc["outputs"][0]["data"] == ["NaN", "Infinity", "-Infinity", 1.5]
    # ...which numpy, hence tritonclient's as_numpy, reads back as the same values.
    back = np.asarray(doc["outputs"][0]["data"], np.float32).reshape(2, 2)
    np.testing.assert_array_equal(back, y)
    plain = parse_json({"inputs": {"x": [[1, 2, 3]]}})
    doc = strict(encode({"y": y}, plain, "")[0])
    assert doc["outputs"]["y"] == [["NaN", "Infinity"], ["-Infinity", 1.5]]


def test_npz_replies_take_any_output_name_and_strings_without_pickle() -> None:
    request = parse_request(_npz(x=np.zeros((1, 3), np.float32)), NPZ, INPUTS)
    outputs = {
        "file": np.ones(2, np.float32),  # np.savez's own first parameter
        "allow_pickle": np.zeros(1),
        "names": np.array(["a", "bé"], dtype=object),  # ORT's string outputs
    }
    body, media = encode(outputs, request, "")
    assert media == NPZ
    with np.load(io.BytesIO(body), allow_pickle=False) as archive:
        assert archive.files == ["file", "allow_pickle", "names"]
        np.testing.assert_array_equal(archive["file"], outputs["file"])
        assert archive["names"].tolist() == ["a", "bé"]
    one = {"names": outputs["names"]}
    body, _ = encode(one, request, NPY)
    assert np.load(io.BytesIO(body), allow_pickle=False).tolist() == ["a", "bé"]


def test_a_request_error_survives_pickling_with_its_status() -> None:
    """Ray Serve pickles a replica's exception back to its proxy (gRPC answers need it)."""
    import pickle

    error = RequestError(429, "busy", {"Retry-After": "1"})
    again = pickle.loads(pickle.dumps(error))
    assert (again.status, again.message, again.headers) == (429, "busy", {"Retry-After": "1"})

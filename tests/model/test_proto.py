"""ONNX's messages without the onnx package: the same classes, and a pool that never imports it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnx
import pytest

from sharedml.model import _dtypes, _proto
from tests._models import batchable_model

REPO = Path(__file__).resolve().parents[2]


def _python(code: str, **env: str) -> dict[str, object]:
    """Run ``code`` in a fresh interpreter; it prints one JSON line last."""
    full_env = {**os.environ, **env}
    full_env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), str(REPO)])
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=180,
        env=full_env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


POOL_RUN = """
    import json, sys
    import numpy as np
    import sharedml

    pool = sharedml.SessionPool({model!r}, sessions={sessions!r}, batching={batching})
    y = pool.run(None, {{"x": np.ones((1, 32), np.float32)}})[0]
    pool.wait_ready()
    print(json.dumps({{"onnx": "onnx" in sys.modules, "ml_dtypes": "ml_dtypes" in sys.modules,
                      "y": y.tolist(), "prepacked": str(pool.mechanism)}}))
    pool.close()
"""


@pytest.mark.parametrize(("sessions", "batching"), [(2, False), (2, True), ("auto", True)])
def test_a_pool_never_imports_onnx(tmp_path: Path, sessions: object, batching: bool) -> None:
    # import onnx costs a second (ml_dtypes 0.7.0's extension alone 0.8 s): a pool's first
    # result must not pay it, neither the first pool (which prepares the model into the cache
    # and builds the prepacked entry) nor a later process (which only reads the entries);
    # sessions="auto" generates its probes' inputs from the graph without onnx too.
    model = batchable_model(tmp_path / "m.onnx")
    code = POOL_RUN.format(model=str(model), sessions=sessions, batching=batching)
    cold = _python(code)
    assert cold["onnx"] is False and cold["ml_dtypes"] is False, cold
    warm = _python(code)
    assert warm["onnx"] is False and warm["ml_dtypes"] is False, warm
    assert np.array_equal(np.array(warm["y"]), np.array(cold["y"]))
    # and the model itself, prepared: no cache lookup of a source at all
    prepared = tmp_path / "prepared" / "m.onnx"
    import sharedml

    sharedml.prepare(model, prepared)
    direct = _python(POOL_RUN.format(model=str(prepared), sessions=sessions, batching=batching))
    assert direct["onnx"] is False, direct
    assert np.array_equal(np.array(direct["y"]), np.array(cold["y"]))


def test_the_standalone_classes_are_onnx_classes_whichever_loads_first() -> None:
    code = """
        import json, pickle, sys
        from sharedml.model import _proto
        ours = _proto.ModelProto
        before = "onnx" in sys.modules
        pickled = pickle.dumps(_proto.parse_model(b""))  # names onnx's module: loads anywhere
        import onnx
        from onnx import helper
        model = helper.make_model(helper.make_graph([], "g", [], []))
        parsed = _proto.parse_model(model.SerializeToString())
        onnx.checker.check_model(parsed)
        print(json.dumps({"before": before, "same": ours is onnx.ModelProto,
                          "module": _proto.pb2().__name__,
                          "isinstance": isinstance(parsed, onnx.ModelProto),
                          "unpickled": type(pickle.loads(pickled)) is onnx.ModelProto}))
    """
    result = _python(code)
    assert result == {
        "before": False,
        "same": True,
        "module": "sharedml._onnx_ml_pb2",
        "isinstance": True,
        "unpickled": True,
    }


def test_in_a_process_that_imported_onnx_the_classes_are_its_own() -> None:
    assert _proto.ModelProto is onnx.ModelProto
    assert _proto.TensorProto is onnx.TensorProto
    assert _proto.parse_model(onnx.ModelProto().SerializeToString()).__class__ is onnx.ModelProto


def test_another_protobuf_backend_falls_back_to_onnx() -> None:
    # With the pure-Python backend a message class is made per module: mixing would break.
    code = """
        import json
        from sharedml.model import _proto
        print(json.dumps({"module": _proto.pb2().__name__}))
    """
    result = _python(code, PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION="python")
    assert result == {"module": "onnx.onnx_ml_pb2"}


def test_np_dtype_agrees_with_onnx_helper_for_every_type() -> None:
    checked = 0
    for name, data_type in onnx.TensorProto.DataType.items():
        try:
            expected = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(data_type))
        except Exception:
            with pytest.raises((KeyError, ValueError, TypeError)):
                _dtypes.np_dtype(data_type)
            continue
        assert _dtypes.np_dtype(data_type) == expected, name
        checked += 1
    assert checked >= 14

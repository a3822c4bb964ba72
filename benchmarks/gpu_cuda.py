"""CUDA: N plain sessions against N sessions over one device copy of the weights.

Builds an MLP with about 1 GiB of fp32 weights (``--layers`` square ``--dim`` MatMuls with
Relu between), prepares it, then measures each configuration in a fresh process, one at a
time:

- device memory: ``torch.cuda.mem_get_info`` (torch only measures; sharedml does not use it),
  taken after torch's own CUDA context exists, so the figure is what ONNX Runtime added:
  once the N sessions exist (``created``), once each ran (``warm``), and after the threads ran
  for ``--seconds`` (``loaded``, the headline figure);
- the time to create the N sessions (for sharedml: weights hashed and uploaded included);
- throughput: N threads, each calling ``run`` in a loop for ``--seconds``;
- outputs: every session's output, and each thread's first output under load, compared with
  the output of one plain session (``equal`` is bitwise; ``max_abs_diff`` is given too).

Plain sessions are ``InferenceSession(model)`` with the CUDA provider's defaults; thread ``i``
uses session ``i``. Shared sessions come from ``sharedml.SessionPool(..., mechanism="device")``
when the installed sharedml has that mechanism; otherwise from ``DeviceWeightStore`` with
plain sessions (the JSON's ``route`` says which). Extra shared variants at the largest N
measure the per-session memory knobs: ``arena_extend_strategy=kSameAsRequested``, one shared
arena in ORT's environment (``session.use_env_allocators=1``) and a 4 MiB cuBLAS workspace
(``CUBLAS_WORKSPACE_CONFIG=:4096:1``, an environment variable cuBLAS reads once per process,
at its first use: measured below).

``scoped-*`` variants set ``CUBLAS_WORKSPACE_CONFIG`` only around the pool's session creation
(and, for most, each session's first run), then restore the environment before the threads
run: can a library scope the setting to its own sessions? Their child then creates one plain
session with the CUDA provider's defaults and runs a torch matmul (``later_*`` fields): does the
setting leak to what the process creates afterwards? ``scoped-4mib-after-*`` first use cuBLAS
(a torch matmul, a plain ORT session) and only then scope the setting around the pool. Measured
on an H200 (``benchmarks/results/gpu-cuda.json``): the scope works only when the pool's session
creation is the process's first use of cuBLAS, and then leaks (a plain session created after
the environment was restored gets the same workspace and numerics); after any earlier cuBLAS
use it has no effect. ``user-stream*`` variants give every pool session one compute stream made
by torch (``has_user_compute_stream``).

Usage (on a machine with onnxruntime-gpu and torch; ``onnxruntime.preload_dlls()`` is called)::

    python benchmarks/gpu_cuda.py --out benchmarks/results/gpu-cuda.json
    python benchmarks/gpu_cuda.py --provider CPUExecutionProvider --dim 256 --layers 4  # smoke

``--summarize RAW`` rebuilds the report from the ``raw`` list of an earlier run.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
MIB = 1 << 20
CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"

CUBLAS_SMALL = {"CUBLAS_WORKSPACE_CONFIG": ":4096:1"}  # 4 MiB, one buffer: cuBLAS's own knob
CUBLAS_1MIB = {"CUBLAS_WORKSPACE_CONFIG": ":1024:1"}
CUBLASLT_1MIB = {"CUBLASLT_WORKSPACE_SIZE": "1024"}  # KiB: cuBLASLt's own workspace knob
SAME = {"arena_extend_strategy": "kSameAsRequested"}
UNIFIED = {"use_ep_level_unified_stream": "1"}  # one stream (and handle set) per session
PER_RUN_STREAMS = {"use_ep_level_unified_stream": "0"}  # overrides the pool's default
LATER_KEYS = (
    "later_plain_created_bytes",
    "later_plain_warm_bytes",
    "later_plain_loaded_bytes",
    "later_plain_runs",
    "later_plain_equal_default",
    "later_plain_equal_variant_numerics",
    "later_torch_matmul_bytes",
    "later_torch_matmul_tensor_bytes",
    "later_error",
)


@dataclasses.dataclass(frozen=True)
class Variant:
    """Settings of one measured configuration beyond (plain | shared, N).

    Attributes:
        options: CUDA provider options.
        env_arena: One arena in ORT's environment for all sessions (``use_env_allocators``).
        env: Environment variables of the measuring process, set before it starts.
        runtime_env: Environment variables set inside the process, after torch's CUDA context
            exists and before onnxruntime is imported (can a library still set them then?).
        threads_per_session: Threads running the N sessions, per session.
        scoped_env: Environment variables set inside the process only for ``scope``, then
            restored (a key absent before is deleted again) before the threads run.
        scope: When ``scoped_env`` is set: ``"create"`` (the sessions' creation),
            ``"create+warmup"`` (creation and each session's first run) or ``"warmup"``.
        later_plain: Afterwards (pool still open), one plain session with the CUDA provider's
            defaults and a torch matmul: the device memory each adds (does a setting leak?).
        user_stream: Every session runs on one compute stream made by torch
            (``has_user_compute_stream=1``, ``user_compute_stream``).
        cublas_before: Use cuBLAS before the measured sessions exist (and before any scoped
            environment): ``"torch"`` (a torch matmul) or ``"ort"`` (a one-MatMul plain CUDA
            session, run once). Device memory is then counted from after that.
    """

    options: dict[str, str] = dataclasses.field(default_factory=dict)
    env_arena: bool = False
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    runtime_env: dict[str, str] = dataclasses.field(default_factory=dict)
    threads_per_session: int = 1
    scoped_env: dict[str, str] = dataclasses.field(default_factory=dict)
    scope: str = "create+warmup"
    later_plain: bool = False
    user_stream: bool = False
    cublas_before: str = ""

    @property
    def numerics(self) -> str:
        """Outputs are compared bitwise with a plain session of the same cuBLAS settings.

        The workspace sizes steer cuBLAS's choice of GEMM algorithm, hence the rounding.
        """
        env = {**self.env, **self.runtime_env, **self.scoped_env}
        keys = ("CUBLAS_WORKSPACE_CONFIG", "CUBLASLT_WORKSPACE_SIZE")
        return ",".join(f"{k}={env[k]}" for k in keys if k in env) or "default"


VARIANTS: dict[str, Variant] = {
    "default": Variant(),
    # The pool's defaults, then a later plain session and torch matmul: the baseline of the
    # later_* figures of the scoped variants.
    "default-then-later": Variant(later_plain=True),
    "same-as-requested": Variant(options=SAME),
    "env-arena": Variant(options=SAME, env_arena=True),
    "cublas-4mib": Variant(options=SAME, env=CUBLAS_SMALL),
    "all": Variant(options=SAME, env_arena=True, env=CUBLAS_SMALL),
    "cublas-4mib-set-at-runtime": Variant(options=SAME, runtime_env=CUBLAS_SMALL, later_plain=True),
    # More threads than sessions: sessions change threads all the time (per-thread state).
    "default-2x-threads": Variant(threads_per_session=2),
    "cublas-4mib-2x-threads": Variant(options=SAME, env=CUBLAS_SMALL, threads_per_session=2),
    # The pool's CUDA default since CUDA_SESSION_DEFAULTS; explicit here, and turned off:
    "unified-stream": Variant(options=UNIFIED),
    "per-run-streams": Variant(options=PER_RUN_STREAMS),
    "cublas-4mib-unified-stream": Variant(options={**SAME, **UNIFIED}, env=CUBLAS_SMALL),
    "cublas-1mib": Variant(options=SAME, env=CUBLAS_1MIB),
    "cublas-4mib-lt-1mib": Variant(options=SAME, env={**CUBLAS_SMALL, **CUBLASLT_1MIB}),
    "tight": Variant(options={**SAME, **UNIFIED}, env={**CUBLAS_1MIB, **CUBLASLT_1MIB}),
    # cuBLAS's workspace set only while the pool creates (and warms up) its sessions:
    "scoped-4mib": Variant(scoped_env=CUBLAS_SMALL, later_plain=True),
    "scoped-1mib": Variant(scoped_env=CUBLAS_1MIB, later_plain=True),
    "scoped-4mib-create-only": Variant(scoped_env=CUBLAS_SMALL, scope="create", later_plain=True),
    "scoped-1mib-create-only": Variant(scoped_env=CUBLAS_1MIB, scope="create", later_plain=True),
    "scoped-4mib-warmup-only": Variant(scoped_env=CUBLAS_SMALL, scope="warmup", later_plain=True),
    # One compute stream (torch's) for every session of the pool:
    "user-stream": Variant(user_stream=True),
    "user-stream-per-run-streams": Variant(options=PER_RUN_STREAMS, user_stream=True),
    "user-stream-scoped-4mib": Variant(user_stream=True, scoped_env=CUBLAS_SMALL),
    # The scoped setting when the process used cuBLAS before (torch, or another ORT session):
    "scoped-4mib-after-torch-matmul": Variant(
        scoped_env=CUBLAS_SMALL, cublas_before="torch", later_plain=True
    ),
    "scoped-4mib-after-ort-session": Variant(
        scoped_env=CUBLAS_SMALL, cublas_before="ort", later_plain=True
    ),
    # The other device routes, forced (for the record: memory and speed of each).
    "route-ort-per-tensor": Variant(env={"SHAREDML_DEVICE_ROUTE": "ort-per-tensor"}),
    "route-cupy-slab": Variant(env={"SHAREDML_DEVICE_ROUTE": "cupy-slab"}),
}


# --------------------------------------------------------------------------------------------
# Model


def build_model(workdir: Path, dim: int, layers: int, seed: int = 0) -> tuple[Path, int]:
    """Write ``mlp.onnx`` + ``mlp.data`` (weights streamed, one layer in memory at a time)."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper

    src = workdir / "mlp.onnx"
    rng = np.random.default_rng(seed)
    inits, nodes = [], []
    h = "x"
    offset = 0
    with open(workdir / "mlp.data", "wb") as fh:
        for i in range(layers):
            # He-scaled so that the activations stay O(1) through the Relu chain.
            w = rng.standard_normal((dim, dim), dtype=np.float32) * np.float32((2.0 / dim) ** 0.5)
            data = w.tobytes()
            fh.write(data)
            t = TensorProto(name=f"W{i}", data_type=TensorProto.FLOAT, dims=[dim, dim])
            t.data_location = TensorProto.EXTERNAL
            for key, value in (("location", "mlp.data"), ("offset", offset), ("length", len(data))):
                entry = t.external_data.add()
                entry.key, entry.value = key, str(value)
            offset += len(data)
            inits.append(t)
            out = "y" if i == layers - 1 else f"h{i}"
            if i == layers - 1:
                nodes.append(helper.make_node("MatMul", [h, f"W{i}"], [out]))
            else:
                nodes.append(helper.make_node("MatMul", [h, f"W{i}"], [f"m{i}"]))
                nodes.append(helper.make_node("Relu", [f"m{i}"], [out]))
            h = out
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", dim])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", dim])],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save_model(model, str(src))
    return src, offset


# --------------------------------------------------------------------------------------------
# One configuration, in its own process


def _device_used(provider: str) -> int:
    if provider == CUDA:
        import torch

        free, total = torch.cuda.mem_get_info(0)
        return int(total - free)
    import psutil

    return int(psutil.Process().memory_full_info().uss)


def _ref_path(workdir: str, numerics: str) -> Path:
    safe = "".join(ch if ch.isalnum() else "_" for ch in numerics)
    return Path(workdir) / f"ref-{safe}.npy"


def _compare(outputs: Sequence[Any], ref_path: Path) -> tuple[bool | None, float | None]:
    import numpy as np

    if not ref_path.exists():
        return None, None
    ref = np.load(ref_path)
    equal = all(np.array_equal(o, ref) for o in outputs)
    diff = max(float(np.max(np.abs(o.astype(np.float64) - ref))) for o in outputs)
    return equal, diff


@contextlib.contextmanager
def _env_set(env: dict[str, str]) -> Any:
    """Set ``env`` in this process, then restore what was there (absent keys deleted again)."""
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, old in before.items():
            if old is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = old


def _later_plain(
    cfg: dict[str, Any], provider: str, base: int, feed: dict[str, Any], ort: Any
) -> dict[str, Any]:
    """One plain session (provider defaults) and a torch matmul, after the measured sessions.

    Each figure is the device memory it added; the session's outputs are compared with the
    default and the variant's references (a leaked cuBLAS setting can change the algorithm).
    """
    out: dict[str, Any] = {}
    try:
        _later_plain_measure(cfg, provider, base, feed, ort, out)
    except Exception as exc:  # keep the variant's own figures
        out["later_error"] = f"{type(exc).__name__}: {exc}"
    return out


def _later_plain_measure(
    cfg: dict[str, Any],
    provider: str,
    base: int,
    feed: dict[str, Any],
    ort: Any,
    out: dict[str, Any],
) -> None:
    before = _device_used(provider) - base
    so = ort.SessionOptions()
    so.log_severity_level = 3
    providers: list[Any] = [(provider, {"device_id": "0"})] if provider != CPU else []
    sess = ort.InferenceSession(cfg["src"], so, providers=[*providers, CPU])
    out["later_plain_created_bytes"] = _device_used(provider) - base - before
    y = sess.run(None, feed)[0]
    out["later_plain_warm_bytes"] = _device_used(provider) - base - before
    stop = time.perf_counter() + 1.0
    runs = 0
    while time.perf_counter() < stop:
        sess.run(None, feed)
        runs += 1
    out["later_plain_loaded_bytes"] = _device_used(provider) - base - before
    out["later_plain_runs"] = runs
    out["later_plain_equal_default"], _ = _compare([y], _ref_path(cfg["workdir"], "default"))
    numerics = VARIANTS[cfg["variant"]].numerics
    out["later_plain_equal_variant_numerics"], _ = _compare(
        [y], _ref_path(cfg["workdir"], numerics)
    )
    if provider == CUDA:
        import torch

        before_t = _device_used(provider)
        a = torch.randn(cfg["dim"], cfg["dim"], device="cuda")
        b = a @ a
        torch.cuda.synchronize()
        out["later_torch_matmul_bytes"] = _device_used(provider) - before_t
        out["later_torch_matmul_tensor_bytes"] = 2 * a.numel() * a.element_size()
        del a, b


def child(cfg: dict[str, Any]) -> dict[str, Any]:
    """Measure one configuration; returns the result dict (printed as JSON by ``main``)."""
    import numpy as np

    provider, n, kind, variant = cfg["provider"], cfg["sessions"], cfg["kind"], cfg["variant"]
    v = VARIANTS[variant]
    options, env_arena, threads_n = v.options, v.env_arena, n * v.threads_per_session
    base = _device_used(provider)  # torch's context exists now; everything after is ORT's
    os.environ.update(v.runtime_env)
    import onnxruntime as ort

    if provider == CUDA:
        ort.preload_dlls()
    from _arena import USE_ENV_ALLOCATORS_KEY, register_shared_arena

    import sharedml
    from sharedml.weights import _device

    if v.cublas_before and provider == CUDA:
        result_before = _use_cublas(v.cublas_before, cfg["dim"], ort)
        base = _device_used(provider)
    stream = None
    if v.user_stream and provider == CUDA:
        import torch

        stream = torch.cuda.Stream()  # kept alive until the sessions are gone
        options = {
            **options,
            "has_user_compute_stream": "1",
            "user_compute_stream": str(int(stream.cuda_stream)),
        }
    providers: list[Any] = [(provider, {"device_id": "0", **options})] if provider != CPU else []
    providers.append(CPU)
    template = ort.SessionOptions()
    template.log_severity_level = 3
    if env_arena:
        if not register_shared_arena(provider, 0):
            raise RuntimeError("could not register a shared device arena")
        template.add_session_config_entry(USE_ENV_ALLOCATORS_KEY, "1")
    x = np.random.default_rng(1).standard_normal((cfg["batch"], cfg["dim"])).astype(np.float32)
    feed = {"x": x}
    result: dict[str, Any] = {**cfg, "ort_version": ort.__version__}
    result["sharedml_file"] = sharedml.__file__
    if v.cublas_before and provider == CUDA:
        result["cublas_before"] = result_before

    pool = None
    sessions: list[Any] = []
    if kind == "shared":
        # Once per process; timed apart from creation (forced by the parent's probe, usually).
        start = time.perf_counter()
        result["selected_route"] = _device.select_route(provider, 0)
        result["select_route_s"] = round(time.perf_counter() - start, 3)
    # The scoped environment: entered here (creation) or before the first runs (warm-up only),
    # left after creation or after the first runs.
    scope = contextlib.ExitStack()
    if v.scoped_env and v.scope in ("create", "create+warmup"):
        scope.enter_context(_env_set(v.scoped_env))
    start = time.perf_counter()
    if kind == "plain":
        sessions = [
            ort.InferenceSession(cfg["src"], template, providers=providers) for _ in range(n)
        ]
        result["route"] = "plain InferenceSession"
    else:
        try:
            pool = sharedml.SessionPool(
                cfg["prepared"],
                sessions=n,
                providers=providers,
                sess_options=template,
                mechanism="device",
            )
            store = getattr(pool, "_device_store", None)
            result["route"] = "sharedml.SessionPool(mechanism='device')"
        except (ValueError, sharedml.ProviderError) as exc:
            result["pool_error"] = f"{type(exc).__name__}: {exc}"
            store = _device.DeviceWeightStore.for_store(
                sharedml.weights.WeightStore.open(cfg["prepared"]), provider, 0
            )
            for _ in range(n):
                so = ort.SessionOptions()
                so.log_severity_level = 3
                if env_arena:
                    so.add_session_config_entry(USE_ENV_ALLOCATORS_KEY, "1")
                store.register(so)
                sessions.append(ort.InferenceSession(cfg["prepared"], so, providers=providers))
            result["route"] = "DeviceWeightStore + InferenceSession"
        if store is not None:
            result["device_route"] = store.route
            result["store_device_bytes"] = store.device_bytes
            result["store_upload_s"] = round(store.upload_seconds, 3)
            result["host_tensors"] = list(store.host_tensors)
    result["create_s"] = round(time.perf_counter() - start, 3)
    result["device_bytes_created"] = _device_used(provider) - base
    if v.scope == "create":
        scope.close()
    elif v.scoped_env and v.scope == "warmup":
        scope.enter_context(_env_set(v.scoped_env))

    # Each session once (all checked out at once from the pool, so each is a different one).
    outputs = []
    after_each = []  # device memory after each session's first run: where the growth comes from
    with contextlib.ExitStack() as stack:
        handles = [stack.enter_context(pool.session()) for _ in range(n)] if pool else sessions
        for sess in handles:
            outputs.append(sess.run(None, feed)[0])
            after_each.append(_mib(_device_used(provider) - base))
    result["device_mib_after_each_first_run"] = after_each
    scope.close()
    if v.scoped_env:
        result["scope"] = v.scope
        result["env_after_scope"] = {k: os.environ.get(k) for k in v.scoped_env}
    ref = _ref_path(cfg["workdir"], v.numerics)
    if kind == "plain" and n == 1 and not ref.exists():
        np.save(ref, outputs[0])
    result["device_bytes_warm"] = _device_used(provider) - base

    # Threads for cfg["seconds"]: thread i uses session i % N (plain) or any free one (pool).
    barrier = threading.Barrier(threads_n + 1)
    counts = [0] * threads_n
    firsts: list[Any] = [None] * threads_n
    errors: list[str] = []
    stop_at = [0.0]

    def work(i: int) -> None:
        run = pool.run if pool is not None else sessions[i % n].run
        try:
            barrier.wait()
            while True:
                out = run(None, feed)[0]
                if firsts[i] is None:
                    firsts[i] = out
                counts[i] += 1
                if time.perf_counter() >= stop_at[0]:
                    return
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(threads_n)]
    for t in threads:
        t.start()
    t0 = time.perf_counter()
    stop_at[0] = t0 + cfg["seconds"]
    barrier.wait()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    if errors:
        raise RuntimeError("; ".join(errors[:3]))
    result["runs"] = sum(counts)
    result["runs_per_s"] = round(sum(counts) / elapsed, 2)
    result["rows_per_s"] = round(sum(counts) * cfg["batch"] / elapsed, 1)
    result["device_bytes_loaded"] = _device_used(provider) - base
    checked = outputs + [f for f in firsts if f is not None]
    result["threads"] = threads_n
    result["numerics"] = v.numerics
    result["outputs_equal"], result["max_abs_diff"] = _compare(checked, ref)
    if v.numerics != "default":
        _, result["max_abs_diff_vs_default"] = _compare(
            checked, _ref_path(cfg["workdir"], "default")
        )
    if v.later_plain:
        result.update(_later_plain(cfg, provider, base, feed, ort))
    if pool is not None:
        result["pool_sessions_created"] = pool.stats().created
        pool.close()
    del stream
    result["libcublas_loaded"] = _loaded_libs("libcublas")
    return result


def _loaded_libs(prefix: str) -> list[str]:
    """The shared libraries of this process whose file name starts with ``prefix`` (Linux)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return []
    paths = {line.split()[-1] for line in maps.splitlines() if "/" in line}
    return sorted(p for p in paths if Path(p).name.startswith(prefix))


def _use_cublas(how: str, dim: int, ort: Any) -> dict[str, Any]:
    """Use cuBLAS once, before the measured sessions (``Variant.cublas_before``)."""
    import numpy as np

    if how == "torch":
        import torch

        a = torch.randn(dim, dim, device="cuda")
        (a @ a).sum().item()
        return {"how": "torch matmul", "env": os.environ.get("CUBLAS_WORKSPACE_CONFIG")}
    from onnx import TensorProto, helper

    w = helper.make_tensor("W", TensorProto.FLOAT, [64, 64], np.ones(64 * 64, np.float32))
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"])],
        "one",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8, 64])],
        initializer=[w],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(
        model.SerializeToString(),
        so,
        providers=[(CUDA, {"device_id": "0"}), CPU],
    )
    sess.run(None, {"x": np.ones((8, 64), np.float32)})
    _KEEP.append(sess)  # alive for the rest of the process, as another library's would be
    return {
        "how": "plain ORT CUDA session, one MatMul",
        "env": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    }


_KEEP: list[Any] = []


# --------------------------------------------------------------------------------------------
# Parent: configurations, one process each, and the report


def configs(
    sessions: Sequence[int], variants: Sequence[str], repeats: int
) -> list[tuple[str, int, str]]:
    """(kind, N, variant), most important first: a run cut short still has the headline.

    The headline pairs (plain and shared at the largest N, default and small cuBLAS workspace)
    come back ``repeats`` times, interleaved, for throughput medians.
    """
    top = max(sessions)
    tuned = "cublas-4mib" if "cublas-4mib" in variants else "default"
    headline = [("shared", top, "default"), ("plain", top, "default")]
    if tuned != "default":
        headline += [("shared", top, tuned), ("plain", top, tuned)]
    # First a plain session per cuBLAS setting: the reference outputs of that setting.
    refs: dict[str, str] = {}
    for v in ["default", *sorted(variants, key=lambda v: bool(VARIANTS[v].scoped_env))]:
        refs.setdefault(VARIANTS[v].numerics, v)  # a process-wide setting where there is one
    order: list[tuple[str, int, str]] = [("plain", 1, v) for v in refs.values()]
    order += headline
    for n in sorted(set(sessions) - {top}):
        order += [("shared", n, "default"), ("plain", n, "default")]
        if tuned != "default":
            order += [("shared", n, tuned)]
    order += [("shared", top, v) for v in variants if not v.startswith("route-")]
    if "same-as-requested" in variants:
        order += [("plain", top, "same-as-requested")]
    order += [("shared", top, v) for v in variants if v.startswith("route-")]
    once = list(dict.fromkeys(order))
    return once + headline * (repeats - 1)


def run_child(cfg: dict[str, Any], timeout_s: float, route: str | None = None) -> dict[str, Any]:
    env = dict(os.environ)
    if route and "SHAREDML_DEVICE_ROUTE" not in env:
        env["SHAREDML_DEVICE_ROUTE"] = route  # the parent probed: children need not again
    env.update(VARIANTS[cfg["variant"]].env)
    paths = [str(REPO / "src"), str(REPO), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(paths).rstrip(os.pathsep)
    env["PYTHONUNBUFFERED"] = "1"
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(cfg)],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=env,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return {**cfg, "error": f"timed out after {timeout_s} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("RESULT "):
            out: dict[str, Any] = json.loads(line[len("RESULT ") :])
            out["wall_s"] = round(time.perf_counter() - start, 1)
            return out
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-6:]
    return {**cfg, "error": f"exit status {proc.returncode}: " + " | ".join(tail)}


def _gpu_name() -> str:
    smi = shutil.which("nvidia-smi")
    if not smi:
        return platform.processor() or platform.machine()
    try:
        out = subprocess.run(
            [smi, "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "unknown GPU"
    return out.splitlines()[0] if out else "unknown GPU"


def _mib(value: int | None) -> float | None:
    return None if value is None else round(value / MIB, 1)


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def summarize(raw: list[dict[str, Any]], meta: dict[str, Any]) -> dict[str, Any]:
    """The report: headline figures, targets, a table (medians over repeats), the raw results."""
    groups: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    for r in raw:
        if "error" not in r:
            groups.setdefault((r["kind"], r["sessions"], r["variant"]), []).append(r)
    weights = meta["weights_bytes"]

    def row(key: tuple[str, int, str]) -> dict[str, Any]:
        rs = groups.get(key, [])
        if not rs:
            return {}
        tp = [r["runs_per_s"] for r in rs]
        loaded = _median([r["device_bytes_loaded"] for r in rs])
        first = rs[0]
        return {
            "kind": key[0],
            "sessions": key[1],
            "variant": key[2],
            "threads": first.get("threads", key[1]),
            "repeats": len(rs),
            "route": first.get("route"),
            "device_route": first.get("device_route"),
            "device_bytes_created": int(_median([r["device_bytes_created"] for r in rs])),
            "device_bytes_warm": int(_median([r["device_bytes_warm"] for r in rs])),
            "device_bytes_loaded": int(loaded),
            "device_mib_loaded": _mib(int(loaded)),
            "x_weights_loaded": round(loaded / weights, 3),
            "create_s": _median([r["create_s"] for r in rs]),
            "runs_per_s": _median(tp),
            "runs_per_s_min_max": [min(tp), max(tp)],
            "numerics": first.get("numerics", "default"),
            "outputs_equal": all(r.get("outputs_equal") is True for r in rs),
            "max_abs_diff": max(r.get("max_abs_diff") or 0.0 for r in rs),
            "max_abs_diff_vs_default": first.get("max_abs_diff_vs_default"),
            **{k: first[k] for k in (*LATER_KEYS, "scope", "env_after_scope") if k in first},
        }

    top = meta["sessions_max"]
    tuned = "cublas-4mib"
    plain, shared = row(("plain", top, "default")), row(("shared", top, "default"))
    plain_t, shared_t = row(("plain", top, tuned)), row(("shared", top, tuned))

    def ratio(a: dict[str, Any], b: dict[str, Any]) -> float | None:
        if not a or not b:
            return None
        return round(a["runs_per_s"] / b["runs_per_s"], 3)

    table = [row(k) for k in groups]
    candidates = [
        r for r in table if r["kind"] == "shared" and r["sessions"] == top and r["outputs_equal"]
    ]
    best = min(candidates, key=lambda r: r["device_bytes_loaded"], default={})
    best_settings = VARIANTS[best["variant"]] if best else None
    at_top = {
        r["variant"]: {
            "device_mib_created": _mib(r["device_bytes_created"]),
            "device_mib_warm": _mib(r["device_bytes_warm"]),
            "device_mib_loaded": r["device_mib_loaded"],
            "x_weights": r["x_weights_loaded"],
            "runs_per_s": r["runs_per_s"],
            "outputs_equal": r["outputs_equal"],
            "numerics": r["numerics"],
            **{k: r[k] for k in ("scope", "env_after_scope") if k in r},
            **{
                k.replace("_bytes", "_mib"): _mib(r[k])
                for k in LATER_KEYS
                if k.endswith("_bytes") and k in r
            },
            **{k: r[k] for k in LATER_KEYS if not k.endswith("_bytes") and k in r},
        }
        for r in table
        if r["kind"] == "shared" and r["sessions"] == top
    }
    by_n = {
        f"{kind}_n{n}": {
            "device_mib_loaded": r["device_mib_loaded"],
            "x_weights": r["x_weights_loaded"],
            "runs_per_s": r["runs_per_s"],
            "outputs_equal": r["outputs_equal"],
        }
        for n in sorted({k[1] for k in groups})
        for kind in ("shared", "plain")
        if (r := row((kind, n, "default")))
    }
    return {
        "benchmark": "benchmarks/gpu_cuda.py",
        "issue": 7,
        "provider": meta["provider"],
        "ort_version": next((r["ort_version"] for r in raw if "ort_version" in r), None),
        "device": meta["device"],
        "model": meta["model"],
        "weights_bytes": weights,
        "sessions": top,
        "route": shared.get("route"),
        "device_route": shared.get("device_route"),
        # Library defaults (CUDA provider defaults, cuBLAS's default workspace):
        "naive_device_bytes": plain.get("device_bytes_loaded"),
        "shared_device_bytes": shared.get("device_bytes_loaded"),
        "naive_x_weights": plain.get("x_weights_loaded"),
        "shared_x_weights": shared.get("x_weights_loaded"),
        "naive_runs_per_s": plain.get("runs_per_s"),
        "shared_runs_per_s": shared.get("runs_per_s"),
        "shared_over_naive_throughput": ratio(shared, plain),
        "naive_create_s": plain.get("create_s"),
        "shared_create_s": shared.get("create_s"),
        "outputs_equal": bool(shared) and shared["outputs_equal"] and plain.get("outputs_equal"),
        # Same, with CUBLAS_WORKSPACE_CONFIG=:4096:1 and kSameAsRequested, for both sides:
        "tuned_settings": {
            "env": CUBLAS_SMALL,
            "cuda_provider_options": SAME,
        },
        "tuned_naive_device_bytes": plain_t.get("device_bytes_loaded"),
        "tuned_shared_device_bytes": shared_t.get("device_bytes_loaded"),
        "tuned_shared_x_weights": shared_t.get("x_weights_loaded"),
        "tuned_naive_runs_per_s": plain_t.get("runs_per_s"),
        "tuned_shared_runs_per_s": shared_t.get("runs_per_s"),
        "tuned_shared_over_naive_throughput": ratio(shared_t, plain_t),
        "tuned_outputs_equal": bool(shared_t)
        and shared_t["outputs_equal"]
        and plain_t.get("outputs_equal"),
        # The CUDA provider options the pool added to every session ("default" variant):
        "pool_cuda_defaults": meta.get("pool_cuda_defaults"),
        "default_by_sessions": by_n,
        "shared_by_variant": at_top,
        # The shared configuration with the least device memory (outputs equal to plain's):
        "best_shared_variant": best.get("variant"),
        "best_shared_settings": {
            "env": {**best_settings.env, **best_settings.runtime_env},
            "cuda_provider_options": best_settings.options,
            "shared_env_arena": best_settings.env_arena,
        }
        if best_settings
        else None,
        "best_shared_device_bytes": best.get("device_bytes_loaded"),
        "best_shared_x_weights": best.get("x_weights_loaded"),
        "best_shared_runs_per_s": best.get("runs_per_s"),
        "targets": {
            "shared_at_most_1.3x_weights": bool(shared) and shared["x_weights_loaded"] <= 1.3,
            "tuned_shared_at_most_1.3x_weights": bool(shared_t)
            and shared_t["x_weights_loaded"] <= 1.3,
            "shared_throughput_at_least_naive": bool(plain and shared)
            and shared["runs_per_s"] >= plain["runs_per_s"],
            "tuned_shared_throughput_at_least_naive": bool(plain_t and shared_t)
            and shared_t["runs_per_s"] >= plain_t["runs_per_s"],
            "best_shared_at_most_1.3x_weights": bool(best) and best["x_weights_loaded"] <= 1.3,
            "best_shared_throughput_at_least_naive": bool(plain and best)
            and best["runs_per_s"] >= plain["runs_per_s"],
        },
        "throughput_note": (
            "GPU-bound: every configuration runs the same kernels. Medians of the repeated "
            "headline configurations; see runs_per_s_min_max in the table for the spread, "
            "which is wider than most differences between configurations."
        ),
        "probes": meta.get("probes", []),
        "table": table,
        "errors": [
            {k: r[k] for k in ("kind", "sessions", "variant", "error")} for r in raw if "error" in r
        ],
        "command": meta["command"],
        "summary_rebuilt_by": meta.get("summary_rebuilt_by"),
        "measured_at": meta["measured_at"],
        "raw": raw,
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, default=REPO / "benchmarks/results/gpu-cuda.json")
    p.add_argument("--provider", default=CUDA)
    p.add_argument("--dim", type=int, default=4096)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--sessions", default="1,4,8")
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--repeats", type=int, default=3, help="of the headline configurations")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--budget-s", type=float, default=420.0, help="skip configurations after this")
    p.add_argument("--child-timeout-s", type=float, default=240.0)
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--summarize", type=Path, help="rebuild the report from an earlier JSON")
    args = p.parse_args(argv)

    if args.child:
        print("RESULT " + json.dumps(child(json.loads(args.child))), flush=True)
        return 0
    if args.summarize:
        old = json.loads(args.summarize.read_text())
        meta = {k: old[k] for k in ("provider", "device", "model", "weights_bytes", "command")}
        meta["summary_rebuilt_by"] = "python benchmarks/gpu_cuda.py " + shlex.join(
            list(argv or sys.argv[1:])
        )
        meta.update(
            pool_cuda_defaults=old.get("pool_cuda_defaults"),
            sessions_max=old["sessions"],
            probes=old.get("probes", []),
            measured_at=old["measured_at"],
        )
        report = summarize(old["raw"], meta)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
        return 0

    sys.path[:0] = [str(REPO / "src"), str(REPO)]
    from sharedml import _device, _providers, prepare

    sessions = [int(s) for s in args.sessions.split(",")]
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="sharedml-gpu-"))
    workdir.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    src, weights_bytes = build_model(workdir, args.dim, args.layers)
    prepared = workdir / "mlp.prepared.onnx"
    prepare(src, prepared)
    built_s = time.perf_counter() - began
    print(f"model: {weights_bytes / MIB:.0f} MiB of weights, built in {built_s:.1f} s", flush=True)

    probes = [
        vars(r) for r in _device.probe_routes(args.provider, 0, stop_at_first=False, refresh=True)
    ]
    for r in probes:
        verdict = "ok" if r["ok"] else "FAILED " + r["reason"]
        print(f"probe {r['route']}: {verdict} ({r['seconds']:.1f} s)", flush=True)

    meta = {
        "provider": args.provider,
        "device": _gpu_name() if args.provider == CUDA else platform.processor(),
        "model": {
            "kind": "MLP (MatMul + Relu)",
            "dim": args.dim,
            "layers": args.layers,
            "batch": args.batch,
            "dtype": "float32",
            "seconds_per_throughput_run": args.seconds,
        },
        "weights_bytes": weights_bytes,
        "sessions_max": max(sessions),
        "pool_cuda_defaults": dict(getattr(_providers, "CUDA_SESSION_DEFAULTS", {})),
        "probes": probes,
        "command": "python benchmarks/gpu_cuda.py " + shlex.join(list(argv or sys.argv[1:])),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }

    def write(report: dict[str, Any]) -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")

    route = next((r["route"] for r in probes if r["ok"]), None)
    raw: list[dict[str, Any]] = []
    for kind, n, variant in configs(sessions, args.variants.split(","), args.repeats):
        if time.perf_counter() - began > args.budget_s:
            raw.append(
                {"kind": kind, "sessions": n, "variant": variant, "error": "skipped: budget"}
            )
            continue
        cfg = {
            "provider": args.provider,
            "kind": kind,
            "sessions": n,
            "variant": variant,
            "dim": args.dim,
            "batch": args.batch,
            "seconds": args.seconds,
            "src": str(src),
            "prepared": str(prepared),
            "workdir": str(workdir),
        }
        r = run_child(cfg, args.child_timeout_s, route)
        raw.append(r)
        write(summarize(raw, meta))  # after every configuration: a run cut short keeps its data
        if "error" in r:
            print(f"{kind:6} N={n} {variant:26} ERROR {r['error']}", flush=True)
        else:
            print(
                f"{kind:6} N={n} {variant:26} created {_mib(r['device_bytes_created'])} MiB, "
                f"loaded {_mib(r['device_bytes_loaded'])} MiB, create {r['create_s']} s, "
                f"{r['runs_per_s']} runs/s, equal={r['outputs_equal']} "
                f"(max diff {r['max_abs_diff']}) [{r.get('route')}] {r['wall_s']} s",
                flush=True,
            )
            if "later_plain_loaded_bytes" in r:
                print(
                    f"{'':6}   later plain session +{_mib(r['later_plain_loaded_bytes'])} MiB "
                    f"(created +{_mib(r['later_plain_created_bytes'])}), equal to default "
                    f"{r['later_plain_equal_default']}; torch matmul "
                    f"+{_mib(r.get('later_torch_matmul_bytes'))} MiB",
                    flush=True,
                )
    report = summarize(raw, meta)
    write(report)
    print(json.dumps({k: v for k, v in report.items() if k not in ("raw", "table")}, indent=1))
    if args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

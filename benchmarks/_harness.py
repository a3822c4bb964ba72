"""The subprocess side of the benchmarks: strategies, model building, one-configuration workers.

``benchmarks/run.py`` never imports onnxruntime itself. It starts this file in a fresh Python
process for every piece of work, one process at a time:

``python benchmarks/_harness.py build SPEC_JSON``
    Generate one model with ``tools/realistic_models.py`` (skipped when the cached file was made
    by the same generator source and arguments), compute reference outputs with one plain
    ``InferenceSession`` (ORT defaults) at every batch size, and prepare the model into
    sharedml's cache, so that no measured configuration pays for a one-off prepare.

``python benchmarks/_harness.py worker SPEC_JSON``
    Measure one configuration (model x strategy x N sessions) once:

    1. baseline: onnxruntime, numpy and sharedml imported, inputs and references loaded;
       ``psutil`` PSS/USS/RSS of this process;
    2. creation: the strategy makes its N sessions (timed);
    3. first run: one run at batch 1 on a fresh session (timed);
    4. for each batch size: N threads, each with its own session (``single``: all on the same
       one), run once (outputs compared with the reference), meet on a barrier, then run in a
       loop. At the first barrier, i.e. once all sessions exist and each has run once
       concurrently, PSS is measured: that is the memory figure of the report. Throughput
       counts the runs in a fixed window that starts ``warmup_s`` after the barrier; a run
       that straddles an edge of the window counts for the fraction inside it, and every
       thread keeps running until the window has closed, so the contention is the same from
       the first to the last second of the window;
    5. PSS again after the batch-8 runs (activation buffers grown), then the result is
       written as JSON.

Strategies are a registry: :func:`strategy` adds one in a few lines (see the end of the
"Strategies" section for the pattern).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import hashlib
import importlib
import json
import os
import resource
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
MIB = 1 << 20
CPU = ["CPUExecutionProvider"]
# Outputs count as equal to the reference under np.allclose with these tolerances. Prepacking
# swaps in blocked GEMM kernels whose float32 sums run in another order, so bit-equality is not
# expected; the max absolute and relative differences are recorded beside the flag.
RTOL = 1e-4
ATOL = 1e-5


# --------------------------------------------------------------------------------------------
# Strategies


@dataclasses.dataclass(frozen=True)
class OpenRequest:
    """What a strategy is asked to build.

    Attributes:
        model_path: The generated model, weights inline as an exporter writes them.
        sessions: N, the number of threads that will run the model concurrently.
        cache_dir: sharedml's cache folder for this benchmark (models are prepared into it by
            the build step, so pools find their entry there).
    """

    model_path: Path
    sessions: int
    cache_dir: Path


@dataclasses.dataclass
class Opened:
    """A strategy's sessions, ready to run.

    Attributes:
        lease: ``lease(i)`` gives thread ``i`` a context manager yielding the session it runs
            on (an object with ``InferenceSession.run``'s signature) for the whole phase.
        close: Releases everything.
        extras: Strategy-specific facts recorded with the result (e.g. the pool's mechanism).
        stats: Called after the runs for more facts (e.g. pool counters); may be ``None``.
    """

    lease: Callable[[int], AbstractContextManager[Any]]
    close: Callable[[], None]
    extras: dict[str, Any] = dataclasses.field(default_factory=dict)
    stats: Callable[[], dict[str, Any]] | None = None


@dataclasses.dataclass(frozen=True)
class Strategy:
    """One way of giving N threads the model.

    Attributes:
        name: Short name used on the command line and in the tables.
        description: One line for the README and the JSON.
        opener: Builds the sessions for an :class:`OpenRequest`.
        copies_fixed: Rough memory need, in copies of the weights, whatever N (used only to
            wait for, or skip on, too little free memory; never reported as a result).
        copies_per_session: Rough extra copies of the weights per session, likewise.
        warm: One-off work done once per model in the build step, before any measurement
            (e.g. preparing the model into sharedml's cache); returns facts to record
            (``what`` it did, ``seconds``).
    """

    name: str
    description: str
    opener: Callable[[OpenRequest], Opened]
    copies_fixed: float
    copies_per_session: float
    warm: Callable[[OpenRequest], dict[str, Any]] | None = None

    def estimated_bytes(self, weights_bytes: int, sessions: int) -> int:
        """A pessimistic guess of the worker's peak memory, to keep the machine out of OOM."""
        copies = self.copies_fixed + self.copies_per_session * sessions
        return int(weights_bytes * copies) + 600 * MIB  # interpreter, ORT, numpy, activations


STRATEGIES: dict[str, Strategy] = {}


def strategy(
    name: str,
    description: str,
    *,
    copies_fixed: float,
    copies_per_session: float,
    warm: Callable[[OpenRequest], dict[str, Any]] | None = None,
) -> Callable[[Callable[[OpenRequest], Opened]], Callable[[OpenRequest], Opened]]:
    """Register a strategy under ``name`` (decorator over its opener); see :class:`Strategy`."""

    def register(opener: Callable[[OpenRequest], Opened]) -> Callable[[OpenRequest], Opened]:
        if name in STRATEGIES:
            raise ValueError(f"Strategy {name!r} is registered twice.")
        STRATEGIES[name] = Strategy(
            name, description, opener, copies_fixed, copies_per_session, warm
        )
        return opener

    return register


@strategy(
    "naive",
    "N plain onnxruntime.InferenceSession over the original model, ORT defaults",
    copies_fixed=1.5,  # the model file's bytes while a session parses it
    copies_per_session=2.2,  # its own initializers plus prepacked copies
)
def _naive(req: OpenRequest) -> Opened:
    import onnxruntime as ort

    sessions = [
        ort.InferenceSession(str(req.model_path), providers=CPU) for _ in range(req.sessions)
    ]
    return Opened(lease=lambda i: contextlib.nullcontext(sessions[i]), close=sessions.clear)


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@strategy(
    "naive-threads",
    "N plain InferenceSession, intra_op_num_threads = cores // N (the thread count the pool "
    "gives its sessions): plain ORT, tuned as a careful user would",
    copies_fixed=1.5,
    copies_per_session=2.2,
)
def _naive_threads(req: OpenRequest) -> Opened:
    # ORT's default gives every session one intra-op thread per core, so N sessions run
    # N x cores threads; the pool divides the cores instead. Without this baseline a pool's
    # throughput edge could not be told apart from its thread setting.
    import onnxruntime as ort

    def options() -> Any:
        so = ort.SessionOptions()
        so.intra_op_num_threads = max(1, _usable_cores() // req.sessions)
        return so

    sessions = [
        ort.InferenceSession(str(req.model_path), options(), providers=CPU)
        for _ in range(req.sessions)
    ]
    return Opened(
        lease=lambda i: contextlib.nullcontext(sessions[i]),
        close=sessions.clear,
        extras={"intra_op_num_threads": max(1, _usable_cores() // req.sessions)},
    )


@strategy(
    "single",
    "one plain InferenceSession (ORT defaults) shared by all N threads",
    copies_fixed=3.7,
    copies_per_session=0.0,
)
def _single(req: OpenRequest) -> Opened:
    import onnxruntime as ort

    holder = [ort.InferenceSession(str(req.model_path), providers=CPU)]
    return Opened(lease=lambda i: contextlib.nullcontext(holder[0]), close=holder.clear)


def _warm_pool(req: OpenRequest) -> dict[str, Any]:
    """Fill the cache as a model's first pool does (a one-off cost).

    That is the prepared model, plus the model with prepacked weights where the pool's default
    route uses one.
    """
    import sharedml

    start = time.perf_counter()
    with sharedml.SessionPool(req.model_path, sessions=1, cache_dir=req.cache_dir) as pool:
        mechanism = pool.mechanism
    return {
        "what": "first SessionPool of the model: prepare (+ prepacked model) into the cache",
        "seconds": time.perf_counter() - start,
        "mechanism": mechanism,
    }


def _pool_opener(
    req: OpenRequest,
    *,
    config: dict[str, str] | None = None,
    attributes: dict[str, Any] | None = None,
    **pool_kwargs: Any,
) -> Opened:
    """A ``sharedml.SessionPool`` of N sessions; each thread checks one out for a whole phase.

    ``config`` entries and ``attributes`` go into a template ``SessionOptions``
    (``sess_options=``).
    """
    import onnxruntime as ort

    import sharedml

    recorded: dict[str, Any] = dict(pool_kwargs)
    if config or attributes:
        so = ort.SessionOptions()
        for key, value in (config or {}).items():
            so.add_session_config_entry(key, value)
        for name, value in (attributes or {}).items():
            setattr(so, name, value)
        pool_kwargs["sess_options"] = so
        recorded.update(config=config or {}, attributes=attributes or {})
    pool = sharedml.SessionPool(
        req.model_path, sessions=req.sessions, cache_dir=req.cache_dir, **pool_kwargs
    )

    def stats() -> dict[str, Any]:
        return dataclasses.asdict(pool.stats())

    return Opened(
        lease=lambda i: pool.session(),
        close=pool.close,
        extras={
            "mechanism": pool.mechanism,
            "mechanism_reason": getattr(pool, "mechanism_reason", None),
            "pool_kwargs": recorded,
        },
        stats=stats,
    )


@strategy(
    "shared",
    "sharedml.SessionPool(model, sessions=N), defaults (prepacking='auto': packed weights "
    "shared through a saved prepacked model where ORT packs any, else raw weights shared)",
    copies_fixed=3.0,
    copies_per_session=0.3,
    warm=_warm_pool,
)
def _shared(req: OpenRequest) -> Opened:
    return _pool_opener(req)


@strategy(
    "shared-raw",
    "SessionPool(..., prepacking='off'): raw weights shared, ORT prepacking off",
    copies_fixed=2.0,
    copies_per_session=0.2,
    warm=_warm_pool,
)
def _shared_raw(req: OpenRequest) -> Opened:
    return _pool_opener(req, prepacking="off")


@strategy(
    "shared-private-packs",
    "SessionPool(..., prepacking='per-session'): raw weights shared, each session packs its own",
    copies_fixed=2.0,
    copies_per_session=1.4,
    warm=_warm_pool,
)
def _shared_private_packs(req: OpenRequest) -> Opened:
    return _pool_opener(req, prepacking="per-session")


@strategy(
    "shared-raw-no-nchwc",
    "SessionPool(..., prepacking='off') with ORT's NchwcTransformer disabled "
    "(optimization.disable_specified_optimizers); opt-in, not in the default set",
    copies_fixed=2.0,
    copies_per_session=0.2,
    warm=_warm_pool,
)
def _shared_raw_no_nchwc(req: OpenRequest) -> Opened:
    # On x86, ORT_ENABLE_ALL rewrites Conv weights into a blocked (NCHWc) layout: new tensors
    # that each session owns, so on the raw route a CNN's weights are not shared. This shows
    # what skipping that one rewrite saves in memory and costs in speed.
    return _pool_opener(
        req,
        prepacking="off",
        config={"optimization.disable_specified_optimizers": "NchwcTransformer"},
    )


@strategy(
    "shared-parallel-start",
    "SessionPool(..., serialize_creation=False): the default route, first sessions created on "
    "one thread per core (faster start-up; glibc keeps some load-time heap in thread arenas)",
    copies_fixed=3.0,
    copies_per_session=0.3,
    warm=_warm_pool,
)
def _shared_parallel_start(req: OpenRequest) -> Opened:
    return _pool_opener(req, serialize_creation=False)


@strategy(
    "shared-no-arena",
    "SessionPool(..., sess_options with enable_cpu_mem_arena=False): the default route, "
    "activation buffers freed after each run instead of kept by each session's arena",
    copies_fixed=3.0,
    copies_per_session=0.3,
    warm=_warm_pool,
)
def _shared_no_arena(req: OpenRequest) -> Opened:
    return _pool_opener(req, attributes={"enable_cpu_mem_arena": False})


# A new strategy is one decorated opener; e.g. a pool option under trial:
#
#     @strategy("shared-xyz", "SessionPool(..., xyz=True)", copies_fixed=2, copies_per_session=0.5,
#               warm=_warm_pool)
#     def _shared_xyz(req: OpenRequest) -> Opened:
#         return _pool_opener(req, xyz=True)
#
# It then appears in --strategies, the tables, the chart and the JSON with nothing else to change.

OPT_IN = frozenset({"shared-raw-no-nchwc", "shared-parallel-start", "shared-no-arena"})
# Strategies run when --strategies is not given.
DEFAULT_STRATEGIES = tuple(name for name in STRATEGIES if name not in OPT_IN)


# --------------------------------------------------------------------------------------------
# Small helpers


def _memory() -> dict[str, float]:
    import psutil

    info = psutil.Process().memory_full_info()
    return {"pss_mib": info.pss / MIB, "uss_mib": info.uss / MIB, "rss_mib": info.rss / MIB}


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _compare(
    outputs: list[Any], reference: list[Any], *, rtol: float = RTOL, atol: float = ATOL
) -> dict[str, Any]:
    """Outputs against reference outputs, output by output.

    Returns ``equal`` (``np.allclose`` under the tolerances, every output), ``max_abs_diff``
    and ``max_rel_diff``: the largest difference relative to its own output's scale (that
    output's largest absolute reference value).
    """
    import numpy as np

    equal = len(outputs) == len(reference)
    max_abs = max_rel = 0.0
    for out, ref in zip(outputs, reference, strict=False):
        out = np.asarray(out)
        if out.shape != ref.shape:
            return {"equal": False, "max_abs_diff": float("inf"), "max_rel_diff": float("inf")}
        diff = np.abs(out.astype(np.float64) - ref.astype(np.float64))
        diff[np.isnan(out) & np.isnan(ref)] = 0.0  # NaN where the reference has NaN: equal
        # A NaN (or infinity) where the reference has a number is the largest difference there
        # is: max() would otherwise skip it and report 0.
        this_abs = float("inf") if np.isnan(diff).any() else float(diff.max(initial=0.0))
        max_abs = max(max_abs, this_abs)
        scale = float(np.abs(ref).max(initial=0.0)) or 1.0
        max_rel = max(max_rel, this_abs / scale)
        equal = equal and bool(np.allclose(out, ref, rtol=rtol, atol=atol))
    return {"equal": equal, "max_abs_diff": max_abs, "max_rel_diff": max_rel}


class _Checks:
    """Collects output comparisons from many threads (tolerances as :func:`_compare`'s)."""

    def __init__(self, *, rtol: float = RTOL, atol: float = ATOL) -> None:
        self._rtol, self._atol = rtol, atol
        self._lock = threading.Lock()
        self.count = 0
        self.equal = True
        self.max_abs_diff = 0.0
        self.max_rel_diff = 0.0

    def add(self, outputs: list[Any], reference: list[Any]) -> None:
        result = _compare(outputs, reference, rtol=self._rtol, atol=self._atol)
        with self._lock:
            self.count += 1
            self.equal = self.equal and result["equal"]
            self.max_abs_diff = max(self.max_abs_diff, result["max_abs_diff"])
            self.max_rel_diff = max(self.max_rel_diff, result["max_rel_diff"])

    def as_dict(self) -> dict[str, Any]:
        """The summary stored in the result."""
        return {
            "outputs_equal": self.equal,
            "max_abs_diff": self.max_abs_diff,
            "max_rel_diff": self.max_rel_diff,
            "outputs_checked": self.count,
        }


def _throwaway_session() -> None:
    import numpy as np
    import onnxruntime as ort

    # The same one-node model inspect's measurements warm up with: same baseline definition.
    from sharedml.inspection._child import warmup_model_bytes as _tiny_model_bytes

    sess = ort.InferenceSession(_tiny_model_bytes(), providers=CPU)
    sess.run(None, {"a": np.ones(1, np.float32)})


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _window_runs(spans: list[tuple[float, float]], start: float, end: float) -> float:
    """Runs inside [start, end], a run straddling an edge counting for its fraction inside."""
    total = 0.0
    for s, e in spans:
        overlap = min(e, end) - max(s, start)
        if overlap > 0 and e > s:
            total += overlap / (e - s)
    return total


def _phase(
    opened: Opened,
    threads: int,
    feeds: dict[str, Any],
    reference: list[Any],
    checks: _Checks,
    *,
    warmup_s: float,
    duration_s: float,
    at_barrier: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Run ``threads`` threads on their leases; see the module docstring, step 4."""
    import numpy as np

    clock: dict[str, float] = {}

    def action() -> None:
        if at_barrier is not None:
            at_barrier()
        now = time.perf_counter()
        clock["start"] = now + warmup_s
        clock["end"] = now + warmup_s + duration_s
        clock["cpu0"] = _cpu_seconds()
        clock["t0"] = now

    barrier = threading.Barrier(threads, action=action)
    spans: list[list[tuple[float, float]]] = [[] for _ in range(threads)]
    errors: list[str] = []

    def body(i: int) -> None:
        try:
            with opened.lease(i) as sess:
                checks.add(sess.run(None, feeds), reference)
                barrier.wait()
                end = clock["end"]
                mine = spans[i]
                while True:
                    s = time.perf_counter()
                    sess.run(None, feeds)
                    e = time.perf_counter()
                    mine.append((s, e))
                    if e >= end:
                        break
        except threading.BrokenBarrierError:
            pass
        except BaseException:
            errors.append(traceback.format_exc())
            barrier.abort()

    workers = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    elapsed = time.perf_counter() - clock.get("t0", 0.0)
    if errors:
        raise RuntimeError(errors[0])
    cpu = (_cpu_seconds() - clock["cpu0"]) / elapsed
    start, end = clock["start"], clock["end"]
    runs = sum(_window_runs(s, start, end) for s in spans)
    latencies = [e - s for mine in spans for s, e in mine if e > start and s < end]
    return {
        "runs_per_s": runs / (end - start),
        "runs_in_window": runs,
        "latency_ms": 1000 * float(np.median(latencies)) if latencies else None,
        "runs_total": sum(len(s) for s in spans),
        # CPU seconds this process got per second of the phase (at most the core count): on a
        # shared machine it shows how much of the CPU the configuration really had.
        "cpu_per_s": cpu,
        # CPU time per run: steadier than runs/s when other processes take CPU, though it
        # also counts the spinning of ORT's idle worker threads.
        "cpu_ms_per_run": 1000 * cpu * elapsed / max(1, sum(len(s) for s in spans)),
    }


# --------------------------------------------------------------------------------------------
# Build step


def _source_digest() -> str:
    text = (REPO / "tools" / "realistic_models.py").read_bytes()
    return hashlib.sha256(text).hexdigest()[:16]


def build(spec: dict[str, Any]) -> dict[str, Any]:
    """Generate (or reuse) one model, its references, and its sharedml cache entry.

    Args:
        spec: ``model`` (a ``tools.realistic_models.REGISTRY`` key), ``size``, ``seed``, ``seq``,
            ``batches``, ``out_dir``, ``cache_dir``, ``strategies`` (whose ``warm`` hooks run).

    Returns:
        The model's description, as stored beside it (``<stem>.json``).
    """
    import numpy as np

    sys.path.insert(0, str(REPO))
    from tools import realistic_models as rm

    models = Path(spec["out_dir"]) / "models"
    models.mkdir(parents=True, exist_ok=True)
    stem = f"{spec['model']}-{spec['size']}-seed{spec['seed']}"
    path = models / f"{stem}.onnx"
    meta_path = models / f"{stem}.json"
    key = {
        "generator_sha": _source_digest(),
        "model": spec["model"],
        "size": spec["size"],
        "seed": spec["seed"],
    }
    meta: dict[str, Any] = {}
    if meta_path.is_file() and path.is_file():
        meta = json.loads(meta_path.read_text())
        if meta.get("key") != key:
            meta = {}
    if not meta:
        start = time.perf_counter()
        info = rm.REGISTRY[spec["model"]](path, size=spec["size"], seed=spec["seed"])
        meta = {
            "key": key,
            "name": info.name,
            "description": info.description,
            "weights_bytes": info.weights_bytes,
            "file_bytes": path.stat().st_size,
            "generate_s": time.perf_counter() - start,
            "inputs": {k: [str(v[0]), list(v[1])] for k, v in info.inputs.items()},
            "vocab_size": info.vocab_size,
            "max_seq": info.max_seq,
            "references": {},
        }
        info_for_inputs = info
    else:
        info_for_inputs = rm.ModelInfo(
            path=str(path),
            name=meta["name"],
            weights_bytes=meta["weights_bytes"],
            inputs={k: (np.dtype(v[0]), tuple(v[1])) for k, v in meta["inputs"].items()},
            description=meta["description"],
            vocab_size=meta["vocab_size"],
            max_seq=meta["max_seq"],
        )
    meta["path"] = str(path)

    ref_key = f"seq{spec['seq']}-b" + "-".join(str(b) for b in spec["batches"])
    ref_path = models / f"{stem}.{ref_key}.npz"
    if not ref_path.is_file() or meta.get("references", {}).get(ref_key) is None:
        import onnxruntime as ort

        sess = ort.InferenceSession(str(path), providers=CPU)
        arrays: dict[str, Any] = {}
        for batch in spec["batches"]:
            feeds = rm.sample_inputs(info_for_inputs, batch=batch, seq=spec["seq"], seed=1)
            for name, value in feeds.items():
                arrays[f"in{batch}/{name}"] = value
            for j, value in enumerate(sess.run(None, feeds)):
                arrays[f"out{batch}/{j}"] = value
        del sess
        tmp = ref_path.with_suffix(".tmp.npz")
        np.savez(tmp, **arrays)
        os.replace(tmp, ref_path)
        meta.setdefault("references", {})[ref_key] = ref_path.name
    meta["reference_path"] = str(ref_path)

    # One-off work of the strategies (sharedml's prepare, ...): timed cold, in a scratch cache,
    # so that the figure is what a user pays the first time whatever this folder already holds;
    # then done for real into the cache the measurements use (usually a hit).
    one_off: dict[str, Any] = {}
    done: dict[Any, dict[str, Any]] = {}
    for name in spec["strategies"]:
        warm = STRATEGIES[name].warm
        if warm is None:
            continue
        if warm not in done:
            with tempfile.TemporaryDirectory(dir=spec["out_dir"], prefix=".scratch-") as scratch:
                done[warm] = warm(OpenRequest(path, 1, Path(scratch)))
            warm(OpenRequest(path, 1, Path(spec["cache_dir"])))
        one_off[name] = done[warm]
    meta["one_off"] = one_off
    meta_path.write_text(json.dumps(meta, indent=2))
    return meta


# --------------------------------------------------------------------------------------------
# Worker


def _load_reference(path: str, batches: list[int]) -> tuple[dict[int, Any], dict[int, Any]]:
    import numpy as np

    feeds: dict[int, dict[str, Any]] = {b: {} for b in batches}
    outs: dict[int, dict[int, Any]] = {b: {} for b in batches}
    with np.load(path) as data:
        for key in data.files:
            kind, name = key.split("/", 1)
            if kind.startswith("in"):
                feeds[int(kind[2:])][name] = data[key]
            else:
                outs[int(kind[3:])][int(name)] = data[key]
    refs = {b: [outs[b][j] for j in sorted(outs[b])] for b in batches}
    return feeds, refs


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Measure one configuration once; see the module docstring.

    Args:
        spec: ``model_path``, ``reference_path``, ``cache_dir``, ``strategy``, ``sessions``,
            ``batches``, ``warmup_s``, ``duration_s``.

    Returns:
        The measurements of this repeat.
    """
    # What any strategy imports is imported before the baseline, so that it is not counted.
    for module in ("numpy", "onnx", "onnxruntime", "sharedml", "psutil"):
        importlib.import_module(module)

    strat = STRATEGIES[spec["strategy"]]
    n = int(spec["sessions"])
    batches = [int(b) for b in spec["batches"]]
    feeds, refs = _load_reference(spec["reference_path"], batches)
    req = OpenRequest(Path(spec["model_path"]), n, Path(spec["cache_dir"]))
    result: dict[str, Any] = {"loadavg_start": os.getloadavg()[0]}

    # One-time costs of any process that runs ORT (its environment, the CPU provider, the
    # first thread pool) are paid by a throwaway session, as sharedml.inspection._measure does, so
    # that
    # the growth below is what the strategy's sessions cost.
    _throwaway_session()
    gc.collect()
    base = _memory()
    result["baseline"] = base

    start = time.perf_counter()
    opened = strat.opener(req)
    result["create_s"] = time.perf_counter() - start
    result["after_create"] = _memory()

    checks = _Checks()
    with opened.lease(0) as sess:
        start = time.perf_counter()
        out = sess.run(None, feeds[batches[0]])
        result["first_run_ms"] = 1000 * (time.perf_counter() - start)
    checks.add(out, refs[batches[0]])
    del out

    measured: dict[str, Any] = {}

    def measure() -> None:
        measured.update(_memory())

    result["throughput"] = {}
    for k, batch in enumerate(batches):
        result["throughput"][str(batch)] = _phase(
            opened,
            n,
            feeds[batch],
            refs[batch],
            checks,
            warmup_s=spec["warmup_s"],
            duration_s=spec["duration_s"],
            at_barrier=measure if k == 0 else None,
        )
    result["after_run_once"] = dict(measured)
    result["after_throughput"] = _memory()
    result.update(checks.as_dict())
    result["extras"] = dict(opened.extras)
    if opened.stats is not None:
        result["extras"]["stats"] = opened.stats()
    opened.close()

    if spec["strategy"].startswith("shared"):
        # What the pool's start-up spent finding its cache entry (load + hash the model); the
        # rest of create_s is mapping/verifying the weights and creating the sessions.
        import sharedml

        start = time.perf_counter()
        sharedml.prepared_model_for(req.model_path, cache_dir=req.cache_dir)
        result["extras"]["cache_lookup_s"] = time.perf_counter() - start

    for key in ("pss_mib", "uss_mib", "rss_mib"):
        result[key] = result["after_run_once"][key] - base[key]
        result[f"{key[:-4]}_after_throughput_mib"] = result["after_throughput"][key] - base[key]
    result["peak_rss_mib"] = _peak_rss_mib()
    result["loadavg_end"] = os.getloadavg()[0]
    return result


# --------------------------------------------------------------------------------------------
# Entry point


def _main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("build", "worker"):
        print("usage: _harness.py build|worker SPEC_JSON", file=sys.stderr)
        return 2
    spec = json.loads(argv[1])
    result = build(spec) if argv[0] == "build" else worker(spec)
    out = spec.get("result_path")
    text = json.dumps(result, indent=1)
    if out:
        Path(out).write_text(text)
    else:
        print(text)
    return 0


@contextlib.contextmanager
def _quiet_ort() -> Iterator[None]:
    # ORT logs warnings (e.g. about thread affinity) at severity 2; keep the child's stderr
    # for real errors.
    import onnxruntime as ort

    ort.set_default_logger_severity(3)
    yield


if __name__ == "__main__":
    with _quiet_ort():
        sys.exit(_main(sys.argv[1:]))

"""The measuring child: creates a strategy's sessions one at a time and records memory.

Started by :func:`sharedml.measure` with one JSON spec, through the child-process runner
(:mod:`sharedml.runtime._child`, which runs :func:`measuring_child`). The child:

1. imports onnxruntime and the strategy, builds the inputs, and creates and drops one tiny
   session with the same providers, so that loading the providers' libraries and ORT's
   environment (one-time costs of any process) are not counted;
2. records the baseline: psutil ``memory_full_info()`` (PSS, USS, RSS), and device memory where
   it can be read;
3. for k = 1 .. N: creates session k, then runs sessions 1..k together, *concurrently* (k
   threads released together by a ``threading.Barrier``), checks that their outputs agree, and
   records memory again; then runs them together again, round after round, until a round adds
   no memory (at most :data:`MAX_ROUNDS`). Point k is therefore "k sessions, run concurrently
   until their memory settled": point N is the total, and the per-extra-session cost is a fit
   over all points. One round is not enough: ORT plans a session's activation memory on its
   first run at a shape and allocates that plan on the second, beside the arena's chunks from
   the first, so a model with large activations holds up to twice as much after two runs as
   after one, and traffic runs every session many times;
4. compares the first session's first outputs with a default plain session's (the parent's
   trial run saved them, ``reference_file``): the largest absolute difference, a numerics check
   of the strategy's settings (a pool's thread count, prepacking) against ORT's defaults;
5. returns its result, which the runner prints as one ``RESULT`` line of JSON on stdout
   (progress lines before it), or an error as its last stderr line and a non-zero exit status.

A spec with ``"mode": "serve"`` measures the strategy as a server holds it (:func:`_child_serve`):
its N sessions created first, then served together by N threads round after round, memory read
untrimmed ("held") and then once more after ``malloc_trim``. The points above add sessions one
at a time and trim before each reading, which makes their per-session slope repeatable, but
leaves another heap behind than serving does: the held figure comes from this process.

A spec with ``"mode": "trial"`` does only the trial run: one plain session with ORT's defaults,
run once on the inputs; its array outputs are saved for the measurements to compare against.
A spec with ``"mode": "family"`` measures a family (``sharedml inspect A B ...``): N plain
sessions, or a pool of N, of every member in one process, and that process's growth.

The headline metric is PSS where the platform has it (Linux): a page mapped by several processes
counts a share in each, and a file mapped once by this process counts once, which is what "how
much RAM does this cost" means. Elsewhere it is USS. With glibc, each reading follows
``malloc_trim(0)``: how much freed heap glibc keeps after session creation varies from run to
run, so the trimmed figure, what the sessions hold, is the repeatable one; the reading before
the trim is kept too. Device memory: with CUDA, the child's own usage through NVML (``pynvml``)
or ``nvidia-smi``; with DirectML it is reported as not measurable; never estimated.
"""

from __future__ import annotations

import gc
import importlib
import json
import math
import os
import queue
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from sharedml._host._platform import available_bytes, heap_trim_available, release_freed_heap
from sharedml.inspection._memory import FALLBACK_NOTES, METRICS, metric_of, read_memory
from sharedml.inspection._strategies import Runner, StrategyContext
from sharedml.model._inputs import generate
from sharedml.runtime._providers import plan_from_spec, runs_rule

__all__ = ["PROGRESS_PREFIX", "SPEC_VERSION", "measuring_child", "warmup_model_bytes"]

SPEC_VERSION = 2
PROGRESS_PREFIX = "PROGRESS "

MIN_ROUNDS = 2  # ORT allocates a shape's planned activation memory on its second run
MAX_ROUNDS = 5  # a point's rounds of runs stop here even if memory still grows
SETTLED_BYTES = 2**20  # a round that adds less than this (or 1% of the growth) adds nothing


def _memory() -> dict[str, Any]:
    """This process's memory (:func:`~sharedml.inspection._memory.read_memory`): every metric."""
    return read_memory()


class _DeviceMemory:
    """This process's device memory, where the provider and platform let it be read."""

    def __init__(self, providers: Sequence[str]) -> None:
        self.metric: str | None = None
        self.note: str | None = None
        self._nvml: Any = None
        primary = providers[0] if providers else "CPUExecutionProvider"
        if primary in ("CUDAExecutionProvider", "TensorrtExecutionProvider"):
            try:
                pynvml = importlib.import_module("pynvml")  # optional: nvidia-ml-py
                pynvml.nvmlInit()
                self._nvml = pynvml
                self.metric = "nvml"
            except Exception:
                if shutil.which("nvidia-smi"):
                    self.metric = "nvidia-smi"
                else:
                    self.note = (
                        "not measurable: neither pynvml (pip install nvidia-ml-py) nor nvidia-smi "
                        "is available"
                    )
        elif primary == "DmlExecutionProvider":
            self.note = (
                "not measurable: DirectML reports no per-process device memory that sharedml can "
                "read; use Task Manager's 'Dedicated GPU memory' column for this process"
            )
        elif primary != "CPUExecutionProvider":
            self.note = f"not measured: sharedml reads device memory only for CUDA, not {primary}"
        self._seen = False

    def read(self) -> int | None:
        """Bytes of device memory this process uses now, or None where it cannot be read."""
        if self.metric is None:
            return None
        pid = os.getpid()
        total = 0
        found = False
        try:
            if self.metric == "nvml":
                nvml = self._nvml
                for index in range(nvml.nvmlDeviceGetCount()):
                    handle = nvml.nvmlDeviceGetHandleByIndex(index)
                    for proc in nvml.nvmlDeviceGetComputeRunningProcesses(handle):
                        if proc.pid == pid and proc.usedGpuMemory is not None:
                            total += int(proc.usedGpuMemory)
                            found = True
            else:
                out = subprocess.run(
                    [
                        "nvidia-smi",
                        "--query-compute-apps=pid,used_memory",
                        "--format=csv,noheader,nounits",
                    ],
                    capture_output=True,
                    text=True,
                    timeout=30,
                    check=True,
                ).stdout
                for line in out.splitlines():
                    fields = [f.strip() for f in line.split(",")]
                    if len(fields) == 2 and fields[0] == str(pid) and fields[1].isdigit():
                        total += int(fields[1]) * 1024 * 1024  # nvidia-smi reports MiB
                        found = True
        except Exception as exc:
            self.note = f"not measurable: reading device memory failed ({exc})"
            self.metric = None
            return None
        self._seen = self._seen or found
        return total

    def finish(self) -> None:
        if self.metric is not None and not self._seen:
            # The driver never listed this process: in a container with its own PID namespace
            # the driver reports host PIDs. Zeros would be invented figures.
            self.note = (
                f"not measurable: {self.metric} does not list this process (a container with its "
                "own PID namespace?)"
            )
            self.metric = None


def warmup_model_bytes() -> bytes:
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Add", ["a", "a"], ["b"])],
        "warmup",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("b", TensorProto.FLOAT, [1])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    data: bytes = model.SerializeToString()
    return data


class _Servers:
    """One thread per session, for the child's life, as a server's threads serve traffic.

    Each session is always run by the same thread: glibc gives each thread a heap arena of its
    own, so which thread runs a session decides where its buffers live and what freed heap
    stays. Threads started anew for every round (an earlier version) scattered them over the
    arenas: a pool of a face CNN held 14% more, one shared session 15% less, than a process
    whose threads served round after round.

    Args:
        concurrent: Run the sessions together (released by a barrier); False (DirectML):
            one after another, from the calling thread.
    """

    def __init__(self, concurrent: bool) -> None:
        self.concurrent = concurrent
        self._runners: list[Runner] = []
        self._jobs: list[queue.Queue[Any]] = []
        self._threads: list[threading.Thread] = []
        self._done: queue.Queue[tuple[int, Any, BaseException | None]] = queue.Queue()

    def add(self, run: Runner) -> None:
        """Serve one more session (its thread starts now where runs are concurrent)."""
        index = len(self._runners)
        self._runners.append(run)
        if not self.concurrent:
            return
        jobs: queue.Queue[Any] = queue.Queue()
        thread = threading.Thread(
            target=self._serve, args=(index, run, jobs), name=f"session-{index}", daemon=True
        )
        self._jobs.append(jobs)
        self._threads.append(thread)
        thread.start()

    def _serve(self, index: int, run: Runner, jobs: queue.Queue[Any]) -> None:
        while (job := jobs.get()) is not None:
            barrier, feeds = job
            try:
                barrier.wait()
                self._done.put((index, run(feeds), None))
            except BaseException as exc:  # re-raised in the calling thread
                self._done.put((index, None, exc))

    def run_all(self, feeds: Mapping[str, Any]) -> tuple[float, list[Any]]:
        """Run every session once, all together on a barrier (or one by one).

        Returns:
            Wall seconds, and each session's outputs in order.
        """
        outputs: list[Any] = [None] * len(self._runners)
        if not self.concurrent:
            start = time.perf_counter()
            for i, run in enumerate(self._runners):
                outputs[i] = run(feeds)
            return time.perf_counter() - start, outputs
        barrier = threading.Barrier(len(self._jobs) + 1)
        for jobs in self._jobs:
            jobs.put((barrier, feeds))
        barrier.wait()
        start = time.perf_counter()
        errors = []
        for _ in self._jobs:
            index, out, error = self._done.get()
            outputs[index] = out
            if error is not None:
                errors.append(error)
        elapsed = time.perf_counter() - start
        if errors:
            raise errors[0]
        return elapsed, outputs

    def close(self) -> None:
        """Stop the threads (each finishes its run first)."""
        for jobs in self._jobs:
            jobs.put(None)
        for thread in self._threads:
            thread.join()
        self._runners.clear()


def _same_outputs(a: Any, b: Any) -> bool:
    """Whether two runs' outputs are bitwise equal (lists of arrays, or anything comparable)."""
    import numpy as np

    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_outputs(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return bool(np.array_equal(np.asarray(a), np.asarray(b)))
    return bool(a == b)


def _given(spec: Mapping[str, Any]) -> dict[str, Any]:
    """The caller's input arrays (``feeds_file``), by name; empty where none were given."""
    if not spec.get("feeds_file"):
        return {}
    from sharedml.model._inputs import load_feeds

    return load_feeds(spec["feeds_file"])


def _feeds(spec: Mapping[str, Any], given: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The inputs: the caller's arrays (``feeds_file``) where given, the rest generated."""
    if given is None:
        given = _given(spec)
    return {
        i["name"]: given[i["name"]] if i.get("source") == "file" else generate(i)
        for i in spec["inputs"]
    }


def _comparable(outputs: Sequence[Any]) -> dict[str, Any]:
    """The numeric array outputs, by position (``out0``...): what a numerics check compares."""
    import numpy as np

    return {
        f"out{i}": out
        for i, out in enumerate(outputs)
        if isinstance(out, np.ndarray) and out.dtype.kind in "biufc"
    }


def _load_reference(reference_file: str) -> dict[str, Any]:
    """The saved outputs of a default plain session, by position.

    Loaded before the baseline is read, so that neither they nor the modules that read them
    count as the sessions' memory.
    """
    import numpy as np

    with np.load(reference_file, allow_pickle=False) as saved:
        return {name: saved[name] for name in saved.files}


def _nonfinite(outputs: Mapping[str, Any]) -> int:
    """How many NaN and infinite values the float outputs hold, all outputs together."""
    import numpy as np

    return sum(
        int(out.size - np.count_nonzero(np.isfinite(out)))
        for out in outputs.values()
        if out.dtype.kind in "fc"
    )


def _difference(
    outputs: Sequence[Any], reference: Mapping[str, Any]
) -> tuple[float | None, int, bool, int]:
    """How far ``outputs`` are from the saved reference.

    Returns:
        The largest absolute difference over the outputs compared (None: nothing comparable
        was saved, shapes, dtypes or NaN positions differ, or either side holds NaN or
        infinite values), how many outputs were compared, whether all of them had the
        reference's shape, dtype and NaN positions, and how many NaN or infinite values the
        two sides hold (the larger count): such outputs are not compared at all.
    """
    import numpy as np

    mine = _comparable(outputs)
    nonfinite = max(_nonfinite(mine), _nonfinite(reference))
    worst = 0.0
    for name, ref in reference.items():
        out = mine.get(name)
        if out is None or out.shape != ref.shape or out.dtype != ref.dtype:
            return None, len(reference), False, nonfinite
        if not np.array_equal(np.isnan(out), np.isnan(ref)):
            return None, len(reference), False, nonfinite
        if out.size and not nonfinite:
            delta = np.abs(out.astype(np.float64) - ref.astype(np.float64))
            worst = max(worst, float(delta.max()))
    if nonfinite:
        return None, len(reference), True, nonfinite
    return (worst if reference else None), len(reference), True, nonfinite


def _child_trial(spec: Mapping[str, Any]) -> dict[str, Any]:
    """One plain session, ORT's defaults, run once; its outputs saved to ``reference_file``."""
    import numpy as np
    import onnxruntime as ort

    feeds = _feeds(spec)
    plan = plan_from_spec(spec)
    so = ort.SessionOptions()
    sess = ort.InferenceSession(spec["model"], so, **plan.session_kwargs(so))
    plan.check_session(sess, f"The trial session of '{spec['model']}'")
    start = time.perf_counter()
    outputs = sess.run(None, feeds)
    seconds = time.perf_counter() - start
    names = [o.name for o in sess.get_outputs()]
    described = []
    for name, out in zip(names, outputs, strict=False):
        if isinstance(out, np.ndarray):
            bad = _nonfinite({name: out}) if out.dtype.kind in "fc" else 0
            described.append(
                {"name": name, "dtype": str(out.dtype), "shape": list(out.shape), "nonfinite": bad}
            )
        else:
            described.append({"name": name, "dtype": type(out).__name__, "shape": None})
    np.savez(spec["reference_file"], **_comparable(outputs))
    return {
        "outputs": described,
        "run_seconds": seconds,
        "onnxruntime": ort.__version__,
        "device": plan.device,
    }


def _growth(now: Mapping[str, Any], base: Mapping[str, Any], key: str) -> int | None:
    a, b = now.get(key), base.get(key)
    return None if a is None or b is None else a - b


DEFAULT_TRAFFIC_SECONDS = 60.0  # per strategy: runs over the tables stop there, partly covered


def _traffic_point(
    base: Mapping[str, Any], base_untrimmed: Mapping[str, Any], metric: str
) -> dict[str, Any]:
    """Memory now against the baseline, as a point (no creation, no timed run)."""
    gc.collect()
    untrimmed = _memory()
    release_freed_heap()
    now = _memory()
    return {
        "sessions": 0,
        "pss_bytes": _growth(now, base, "pss"),
        "uss_bytes": _growth(now, base, "uss"),
        "rss_bytes": _growth(now, base, "rss"),
        "private_bytes": _growth(now, base, "private"),
        "untrimmed_bytes": _growth(untrimmed, base_untrimmed, metric),
        "device_bytes": None,
        "create_seconds": 0.0,
        "run_seconds": 0.0,
        "outputs_agree": True,
    }


def _run_over_tables(
    spec: Mapping[str, Any],
    runners: Sequence[Runner],
    feeds: Mapping[str, Any],
    reading: Any,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Run each session over inputs whose ids cover the indexed tables' rows, one at a time.

    After session k has run over them, memory is read: point k. The first session runs
    until every row is covered or its share of the time (``traffic_seconds`` / N) is up;
    the others run as many, so that every session read the same rows.

    Returns:
        The points, and what was done (``runs``, ``runs_needed``, ``rows`` covered per
        table, ``seconds``, ``partial``, ``error``); no points where there is nothing to run.
    """
    from sharedml.model._tables import covering_feeds, runs_to_cover

    tables = list(spec.get("tables") or ())
    needed = runs_to_cover(tables, spec["inputs"]) if tables else 0
    if not needed or not runners:
        return [], {}
    budget = float(spec.get("traffic_seconds") or DEFAULT_TRAFFIC_SECONDS) / len(runners)
    points: list[dict[str, Any]] = []
    allowed = needed
    start = time.perf_counter()
    try:
        for k, run in enumerate(runners, start=1):
            began = time.perf_counter()
            done = 0
            for feed in covering_feeds(tables, spec["inputs"], feeds):
                if done >= allowed or (k == 1 and time.perf_counter() - began > budget):
                    break
                run(feed)
                done += 1
            allowed = done
            point = reading()
            point["sessions"] = k
            point["run_seconds"] = time.perf_counter() - began
            points.append(point)
    except Exception as exc:  # the model refuses the ids: say so, measure nothing of it
        text = " ".join((str(exc).strip() or type(exc).__name__).split())
        return [], {"error": f"{type(exc).__name__}: {text}", "runs_needed": needed}
    shapes = {str(i["name"]): i["shape"] for i in spec["inputs"]}
    rows: dict[str, int] = {}
    for t in tables:
        if t.get("input") is None or t["input"] not in shapes:
            continue
        per_run = 1
        for axis, d in enumerate(shapes[t["input"]]):
            if t.get("block") is None or axis != t["block"][0] % len(shapes[t["input"]]):
                per_run *= int(d)
        rows[t["name"]] = min(int(t["rows"]), allowed * per_run)
    return points, {
        "runs": allowed,
        "runs_needed": needed,
        "rows": rows,
        "seconds": time.perf_counter() - start,
        "partial": allowed < needed,
        "error": None,
    }


def _run_until_settled(
    servers: _Servers,
    feeds: Mapping[str, Any],
    base: Mapping[str, Any],
    metric: str,
    reading: Callable[[], dict[str, Any]] | None = None,
    at_least: int = MIN_ROUNDS,
) -> tuple[int, bool]:
    """After a point's first round: more rounds of the same runs until one adds no memory.

    ``reading`` reads memory after each round (default: trimmed, :func:`_settled_memory`);
    ``at_least``: rounds to run in any case (at most :data:`MAX_ROUNDS`).

    Returns:
        How many rounds ran in all (the first included), and whether the last one added
        nothing (False: :data:`MAX_ROUNDS` ran and memory still grew).
    """
    read = reading or _settled_memory
    rounds = 1
    before = _growth(read(), base, metric) or 0
    while rounds < MAX_ROUNDS:
        servers.run_all(feeds)
        rounds += 1
        now = _growth(read(), base, metric) or 0
        added, before = now - before, now
        if rounds >= max(MIN_ROUNDS, at_least) and added < max(SETTLED_BYTES, 0.01 * now):
            return rounds, True
    return rounds, False


def _settled_memory() -> dict[str, Any]:
    """This process's memory once freed objects and freed heap are given back."""
    gc.collect()
    release_freed_heap()
    return _memory()


def _held_memory() -> dict[str, Any]:
    """This process's memory as it holds it: freed Python objects collected, the heap untrimmed.

    A server process never trims: the heap that glibc keeps after sessions were created and
    ran is memory that process holds, and no other process can use.
    """
    gc.collect()
    return _memory()


def _child_family(spec: Mapping[str, Any]) -> dict[str, Any]:
    """N sessions of every member of a family, each run twice: this process's memory growth.

    ``family_mode``: ``"plain"`` (ORT sessions), ``"pooled"`` (a pool per member, sharedml's
    defaults) or ``"raw"`` (pools with prepacking off). ``dims``, ``shapes`` and the caller's
    arrays name what any member has: each member takes the ones it has; symbolic dims nobody
    gave are 1 here (the family's members must agree on one size), where single-model inspect
    chooses plausible sizes and reports them.

    Returns:
        ``{"pss": growth in bytes, "metric": what was read, "mechanisms": each pool's}``.
    """
    import contextlib

    import onnxruntime as ort

    import sharedml
    from sharedml.model._graph import load_graph
    from sharedml.model._inputs import described, input_specs

    if spec.get("version") != SPEC_VERSION:
        raise ValueError(f"spec version {spec.get('version')} is not {SPEC_VERSION}")
    mode, n = spec["family_mode"], int(spec["sessions"])
    given = _given(spec)
    feeds = []
    for model in spec["models"]:
        graph = load_graph(model)
        axes = {
            i.name: [d.dim_param for d in i.type.tensor_type.shape.dim] for i in graph.graph.input
        }
        dims = {k: v for k, v in spec["dims"].items() if any(k in a for a in axes.values())}
        shapes = {k: v for k, v in spec["shapes"].items() if k in axes}
        values = {k: v for k, v in given.items() if k in axes}
        specs = input_specs(
            graph, dims, shapes=shapes, given=described(values), model_name=model, guess="ones"
        )
        feeds.append(_feeds({"inputs": [s.to_dict() for s in specs]}, values))
    sharedml.SessionPool  # noqa: B018 - the modules load lazily: before the baseline
    base = _settled_memory()
    metric = metric_of(base)
    if metric is None:  # not even RSS: nothing to measure with, and no figure to invent
        raise RuntimeError(f"this process's memory cannot be read here ({base['error']})")
    held: list[Any] = []
    mechanisms: list[str] = []
    try:
        for model, feed in zip(spec["models"], feeds, strict=True):
            if mode == "plain":
                sessions = [
                    ort.InferenceSession(model, providers=["CPUExecutionProvider"])
                    for _ in range(n)
                ]
                for _ in range(MIN_ROUNDS):  # the activation plan is allocated on the second
                    for session in sessions:
                        session.run(None, feed)
                held.append(sessions)
                continue
            pool = sharedml.SessionPool(
                model, sessions=n, prepacking="off" if mode == "raw" else "auto"
            )
            held.append(pool)
            pool.wait_ready()
            with contextlib.ExitStack() as stack:  # every session checked out, each run
                checked_out = [stack.enter_context(pool.session()) for _ in range(n)]
                for _ in range(MIN_ROUNDS):
                    for session in checked_out:
                        session.run(None, feed)
            mechanisms.append(str(pool.mechanism))
        grown = _settled_memory()[metric] - base[metric]
    finally:
        for h in held:
            if not isinstance(h, list):
                h.close()
    return {"pss": grown, "metric": metric, "mechanisms": mechanisms}


def _strategy(spec: Mapping[str, Any]) -> tuple[Any, StrategyContext]:
    """The strategy's factory and the context it is called with, from the spec."""
    if spec.get("version") != SPEC_VERSION:
        raise ValueError(f"spec version {spec.get('version')} is not {SPEC_VERSION}")
    module_name, _, func_name = spec["factory"].partition(":")
    factory = getattr(importlib.import_module(module_name), func_name)
    plan = plan_from_spec(spec)  # a plugin EP's library registered here, its device chosen
    ctx = StrategyContext(
        model_path=Path(spec["model"]),
        sessions=int(spec["sessions"]),
        providers=plan.providers,
        provider_options=plan.provider_options,
        plan=plan,
    )
    return factory, ctx


def _load_everything(ctx: StrategyContext) -> None:
    """What any process that uses these providers has paid before its sessions: not counted.

    sharedml's own modules (and onnx, which they import) load on first use: all of them are
    loaded now, so that a pooled strategy's first SessionPool does not count their imports
    (nor its once-per-process probes of onnxruntime) as its sessions' memory, and plain
    strategies are measured over the same baseline. Then the providers' libraries, ORT's
    environment and thread pools, through a throwaway session. sharedml's own cost (imports,
    probes, creation thread) is measured on its own (``fixed_cost`` in ``_measure``).
    """
    import sharedml

    for name in sharedml.__all__:
        getattr(sharedml, name)
    if ctx.providers[0] == "CPUExecutionProvider":
        # What a process's first CPU pool probes once (tiny sessions that try what this
        # onnxruntime can do): sharedml's own cost, as its imports are, not a pool's; about
        # 1 MiB that a small classifier's pool otherwise showed over plain sessions.
        from sharedml.runtime._capabilities import capability
        from sharedml.weights._store import zero_copy_mechanisms

        capability("prepacked-save")
        capability("files-in-memory")
        zero_copy_mechanisms()
    warmup = ctx.plain_session(warmup_model_bytes())
    warmup.run(None, {"a": generate({"shape": [1], "dtype": "float32"})})
    del warmup
    gc.collect()


def _child_serve(spec: Mapping[str, Any]) -> dict[str, Any]:
    """N sessions created, then served together as a server serves them; memory held and trimmed.

    A server creates its sessions, then its threads run them round after round and nothing
    trims its heap. The measuring child's points add sessions one at a time instead, which
    leaves another heap behind (a face CNN's pool held 14% more there, one shared session 15%
    less): the held figure comes from this process. After the held reading, one trim, and the
    trimmed reading: what the same sessions hold without the freed heap glibc kept.

    Returns:
        ``{"metric", "rounds", "settled", "held": {metric: growth}, "trimmed": {...}}``.
    """
    factory, ctx = _strategy(spec)
    feeds = _feeds(spec)
    assert ctx.plan is not None
    concurrent = not runs_rule(ctx.plan).serialized
    _load_everything(ctx)
    trimmed = heap_trim_available()
    release_freed_heap()  # the one trim before the end: every strategy starts from a clean heap
    base = _memory()
    metric = metric_of(base)
    if metric is None:
        raise RuntimeError(f"this process's memory cannot be read here ({base['error']})")
    sessions = factory(ctx)
    servers = _Servers(concurrent)
    try:
        runners = [sessions.add() for _ in range(ctx.sessions)]  # created first, as a server's
        for run in runners:
            servers.add(run)
        servers.run_all(feeds)
        rounds, settled = _run_until_settled(
            servers, feeds, base, metric, reading=_held_memory, at_least=int(spec["rounds"])
        )
        held = _held_memory()
        after_trim = _settled_memory() if trimmed else held
    finally:
        servers.close()
        runners = []
        sessions.close()
    return {
        "metric": metric,
        "rounds": rounds,
        "settled": settled,
        "held": {key: _growth(held, base, key) for key in METRICS},
        "trimmed": {key: _growth(after_trim, base, key) for key in METRICS},
    }


def _child_measure(spec: Mapping[str, Any]) -> dict[str, Any]:
    import onnxruntime as ort

    factory, ctx = _strategy(spec)
    plan, providers = ctx.plan, ctx.providers
    assert plan is not None
    feeds = _feeds(spec)
    plain = _load_reference(spec["reference_file"]) if spec.get("reference_file") else None
    reserve = int(spec["memory_reserve_bytes"])
    # Where the provider table says runs must not overlap (DirectML, WebGPU, a provider it does
    # not know), the child runs its sessions one at a time: together they would crash.
    concurrent = not runs_rule(plan).serialized
    device = _DeviceMemory(providers)
    _load_everything(ctx)
    base_untrimmed = _memory()
    trimmed = heap_trim_available()
    release_freed_heap()
    base = _memory()
    base_device = device.read()
    metric = metric_of(base)
    if metric is None:  # not even RSS: nothing to measure with, and no figure to invent
        raise RuntimeError(f"this process's memory cannot be read here ({base['error']})")
    metric_note = None
    if metric != "pss":
        why = base["error"] or "this platform has no PSS"
        metric_note = f"{metric.upper()}, because {why}: {FALLBACK_NOTES[metric]}"
    start = time.perf_counter()
    sessions = factory(ctx)
    setup_seconds = time.perf_counter() - start
    runners: list[Runner] = []
    servers = _Servers(concurrent)
    points: list[dict[str, Any]] = []
    stopped: str | None = None
    plain_diff: float | None = None
    plain_compared = 0
    plain_comparable = True
    plain_nonfinite = 0
    largest_step = 0
    previous = 0
    reference: Any = None  # the first session's first outputs: every later run must equal them
    try:
        for k in range(1, ctx.sessions + 1):
            if k > 1:
                room = available_bytes() - reserve
                if room < 1.5 * largest_step:
                    stopped = (
                        f"stopped after {k - 1} of {ctx.sessions} sessions to leave "
                        f"{reserve / 2**20:.0f} MiB free: each session needs up to "
                        f"{largest_step / 2**20:.0f} MiB, {max(room, 0) / 2**20:.0f} MiB was "
                        "left; larger counts are projected"
                    )
                    break
            start = time.perf_counter()
            runners.append(sessions.add())
            create_seconds = time.perf_counter() - start
            servers.add(runners[-1])
            run_seconds, outputs = servers.run_all(feeds)
            rounds, settled = _run_until_settled(servers, feeds, base, metric)
            if reference is None:
                reference = outputs[0]
                if plain is not None:
                    plain_diff, plain_compared, plain_comparable, plain_nonfinite = _difference(
                        reference, plain
                    )
            agree = all(_same_outputs(out, reference) for out in outputs)
            gc.collect()
            untrimmed = _memory()
            release_freed_heap()
            now = _memory()
            dev = device.read()
            growth = _growth(now, base, metric) or 0
            largest_step = max(largest_step, growth - previous)
            previous = growth
            points.append(
                {
                    "sessions": k,
                    "pss_bytes": _growth(now, base, "pss"),
                    "uss_bytes": _growth(now, base, "uss"),
                    "rss_bytes": _growth(now, base, "rss"),
                    "private_bytes": _growth(now, base, "private"),
                    "untrimmed_bytes": _growth(untrimmed, base_untrimmed, metric),
                    "device_bytes": (
                        dev - base_device if dev is not None and base_device is not None else None
                    ),
                    "create_seconds": create_seconds,
                    "run_seconds": run_seconds,
                    "outputs_agree": agree,
                    "rounds": rounds,
                    "settled": settled,
                }
            )
            print(f"{PROGRESS_PREFIX}{k} {ctx.sessions}", flush=True)
        traffic_points, traffic = _run_over_tables(
            spec, runners, feeds, lambda: _traffic_point(base, base_untrimmed, metric)
        )
        describe = getattr(sessions, "details", None)
        details = dict(describe()) if callable(describe) else {}
    finally:
        servers.close()
        runners.clear()
        sessions.close()
    device.finish()
    if device.metric is None:
        for point in points:
            point["device_bytes"] = None
    return {
        "metric": metric,
        "metric_note": metric_note,
        "baseline_bytes": base[metric],
        "trimmed": trimmed,
        "setup_seconds": setup_seconds,
        "concurrent": concurrent,
        "device": plan.device,
        "points": points,
        "device_metric": device.metric,
        "device_note": device.note,
        "stopped_reason": stopped,
        "onnxruntime": ort.__version__,
        "details": details,
        "plain_max_abs_diff": plain_diff,
        "plain_outputs_compared": plain_compared,
        "plain_outputs_comparable": plain_comparable,
        "plain_outputs_nonfinite": plain_nonfinite,
        "traffic_points": traffic_points,
        "traffic": traffic,
    }


def measuring_child(spec_json: str) -> dict[str, Any]:
    """What a measuring child does with its spec (run by the child-process runner's entry).

    Args:
        spec_json: The spec: a strategy to measure, ``"mode": "trial"`` or ``"mode": "family"``.

    Returns:
        The result, printed as the child's ``RESULT`` line.
    """
    spec = json.loads(spec_json)
    if spec.get("mode") == "trial":
        return _child_trial(spec)
    if spec.get("mode") == "family":
        return _child_family(spec)
    if spec.get("mode") == "serve":
        return _child_serve(spec)
    result = _child_measure(spec)
    if not all(math.isfinite(p["run_seconds"]) for p in result["points"]):
        raise ValueError("a run time is not finite")
    return result

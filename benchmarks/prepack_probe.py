r"""Probe which CPU route gives N ORT sessions one copy of the weights AND prepacked speed.

Every measurement runs in a fresh subprocess, so that one configuration's allocations (or the
pages it mapped) can neither hide nor inflate another's.

Memory: growth of the child's PSS / USS (psutil) and anonymous memory (``smaps_rollup``) from
"ORT imported, inputs built" to "N sessions created and each run once", then again after glibc's
``malloc_trim(0)`` (the same sessions: trimming changes no ORT state). Within ONE process PSS is
the honest figure: a page mapped k times counts 1/k per mapping. USS misleads here: a file page
mapped once is "private" (so one mapped copy of the weights shows in USS), the same page mapped
twice is "shared" and vanishes from it. ``anon`` is heap: copies no file backs.

Throughput: N=4 sessions, each driven by its own Python thread (``Run`` releases the GIL), started
together on a barrier, ``intra_op_num_threads=1`` (4 threads already oversubscribe 2 cores);
trials of the configurations interleaved. Reported: runs/s summed over the threads, and CPU ms
per run (process CPU time / runs), the steadier figure on a shared VM whose other tenants lower
runs/s but hardly the CPU one run costs.

Commands behind the tables of docs/cpu-prepacking.md::

    python benchmarks/prepack_probe.py mem                         # MLPs, N=1,4,8, all routes
    python benchmarks/prepack_probe.py tput                        # MLPs, batch 1 and 8
    python benchmarks/prepack_probe.py mem --models bert,resnet --ns 1,4 \
        --configs plain,extmem-noprepack,extmem-noprepack+ext,extmem-prepack,saved-file,pool
    C=saved-file; python benchmarks/prepack_probe.py mem --models mlp200 --ns 8 --configs \
        $C,$C+noarena,$C+devalloc,$C+t1,$C+nomempat,$C+envalloc,$C+globaltp,$C+mmapthr,$C+optall
    python benchmarks/prepack_probe.py mem --models mlp200 --ns 1,8 \
        --configs pool,pool+noarena,pool+t1,pool+noarena+t1

Models (``--models``): ``mlp200`` (12 x 2048x2048 MatMul+Add+Relu, 192 MiB), ``mlp100`` (6 layers,
96 MiB), and the full-size generators of ``tools/realistic_models.py`` (``bert``, ``gpt2``,
``resnet``). Each is written once under ``--work`` as ``inline.onnx`` (weights inside),
``ext.onnx`` + ``ext.bin`` (one external data file), ``saved/opt.*`` and the pool's cache entry.

Configurations (``--configs``, comma-separated; ``+modifier`` suffixes combine):

    plain              InferenceSession(model with the weights inside the .onnx)
    plain-noprepack    same, session.disable_prepacking=1
    extfile-noprepack  ext.onnx loaded by path: ORT maps ext.bin itself; prepacking off
    extfile-prepack    same, prepacking on
    extmem-noprepack   ext.bin handed over zero-copy: one numpy memmap for all sessions,
                       add_external_initializers_from_files_in_memory +
                       session.use_external_initializer_file_buffers_directly=1; prepacking off
    extmem-prepack     same, prepacking on
    saved-file         optimized at ORT_ENABLE_EXTENDED and saved with
                       session.save_external_prepacked_constant_initializers=1; reloaded by
                       path with optimizations off
    saved-mem          same, but its data file handed over as in extmem
    pool               sharedml.weights._prepacked.build_prepacked_model() (ORT's default level,
    ALL)
                       + PrepackedModel.apply(): what the session pool does

    +noarena   enable_cpu_mem_arena=False       +nomempat  enable_mem_pattern=False
    +devalloc  use_device_allocator_for_initializers=1
    +envalloc  session.use_env_allocators=1 over a registered shared CPU arena
    +t1        intra_op_num_threads=1           +globaltp  global thread pool of 1 thread
    +noprepack session.disable_prepacking=1     +ext       ORT_ENABLE_EXTENDED, not ALL
    +optall    saved-*: keep ORT_ENABLE_ALL on reload
    +trim      malloc_trim(0) before the first measurement, too
    +mmapthr   mallopt(M_MMAP_THRESHOLD, 128 KiB) before creating sessions
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
MLPS = {"mlp200": (12, 2048), "mlp100": (6, 2048)}  # name: (layers, width); 4 * L * W^2 bytes
SEQ = {"bert": 64, "gpt2": 64}  # sequence length fed to the transformer generators
DEFAULT_MEM_CONFIGS = (
    "plain",
    "plain-noprepack",
    "extfile-noprepack",
    "extfile-prepack",
    "extmem-noprepack",
    "extmem-prepack",
    "saved-file",
    "saved-mem",
    "pool",
)
DEFAULT_TPUT_CONFIGS = ("plain", "plain-noprepack", "extmem-noprepack", "extmem-prepack", "pool")
MiB = 1 << 20
M_MMAP_THRESHOLD = -3  # glibc mallopt parameter


# -------------------------------------------------------------------------------------- models


def make_models(work: Path, name: str) -> Path:
    """Write ``<work>/<name>/`` once: the model variants, reference outputs, the pool's entry."""
    d = work / name
    if (d / "ref.npz").exists():
        return d
    d.mkdir(parents=True, exist_ok=True)
    # Sessions write the saved model, so everything is made in children: the parent never
    # holds ORT state. Building the pool's entry here keeps the build out of every measurement.
    for cfg in ({"kind": "make", "model": name}, {"kind": "mem", "config": "pool", "n": 1}):
        r = _run_child({**cfg, "dir": str(d)}, timeout_s=900)
        if "error" in r:
            raise SystemExit(f"making {name} failed: {r['error']}")
    return d


def _child_make(cfg: dict[str, Any]) -> dict[str, Any]:
    import numpy as np
    import onnx
    import onnxruntime as ort

    d, name = Path(cfg["dir"]), cfg["model"]
    if name in MLPS:
        model, feeds = _mlp(*MLPS[name])
    else:
        sys.path.insert(0, str(REPO / "tools"))
        import realistic_models as rm

        info = rm.REGISTRY[name](d / "gen.onnx", size="full", seed=0)
        model = onnx.load(d / "gen.onnx")
        (d / "gen.onnx").unlink()
        seq = SEQ.get(name, 16)
        feeds = {bs: rm.sample_inputs(info, batch=bs, seq=seq, seed=bs) for bs in (1, 8)}
    onnx.save(model, d / "inline.onnx")
    onnx.save(
        model,
        d / "ext.onnx",
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location="ext.bin",
        size_threshold=1024,
    )
    del model
    (d / "saved").mkdir(exist_ok=True)
    so = ort.SessionOptions()
    # EXTENDED: the level ORT recommends for saved models (ALL bakes in hardware-specific
    # layouts). The "pool" configuration uses ALL; its cache key names the CPU.
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    so.optimized_model_filepath = str(d / "saved" / "opt.onnx")
    for key, value in (
        ("session.optimized_model_external_initializers_file_name", "opt.bin"),
        ("session.optimized_model_external_initializers_min_size_in_bytes", "1024"),
        ("session.save_external_prepacked_constant_initializers", "1"),
    ):
        so.add_session_config_entry(key, value)
    ort.InferenceSession(str(d / "ext.onnx"), so, providers=["CPUExecutionProvider"])
    ref = ort.InferenceSession(str(d / "inline.onnx"), providers=["CPUExecutionProvider"])
    arrays = {}
    for bs, f in feeds.items():
        arrays.update({f"b{bs}:in:{k}": v for k, v in f.items()})
        arrays.update({f"b{bs}:out:{i}": y for i, y in enumerate(ref.run(None, f))})
    np.savez(d / "ref.npz", **arrays)
    return {"ok": True}


def _mlp(layers: int, width: int) -> tuple[Any, dict[int, dict[str, Any]]]:
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    nodes, inits, x = [], [], "x"
    for i in range(layers):
        w = rng.standard_normal((width, width), dtype=np.float32) / np.float32(np.sqrt(width))
        b = np.full(width, 0.01, np.float32)
        inits += [numpy_helper.from_array(w, f"W{i}"), numpy_helper.from_array(b, f"b{i}")]
        nodes += [
            helper.make_node("MatMul", [x, f"W{i}"], [f"mm{i}"]),
            helper.make_node("Add", [f"mm{i}", f"b{i}"], [f"a{i}"]),
            helper.make_node("Relu", [f"a{i}"], [f"h{i}"]),
        ]
        x = f"h{i}"
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", width])],
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["N", width])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    feeds = {bs: {"x": rng.standard_normal((bs, width), dtype=np.float32)} for bs in (1, 8)}
    return model, feeds


def _feeds(d: Path, batch: int) -> tuple[dict[str, Any], list[Any]]:
    """Inputs for ``batch`` and a plain session's outputs for them (from ref.npz)."""
    import numpy as np

    ref = np.load(d / "ref.npz")
    feeds = {k.split(":", 2)[2]: ref[k] for k in ref.files if k.startswith(f"b{batch}:in:")}
    prefix = f"b{batch}:out:"
    outs = sorted((int(k[len(prefix) :]), ref[k]) for k in ref.files if k.startswith(prefix))
    return feeds, [y for _, y in outs]


# ------------------------------------------------------------------------------------ sessions


def _mem() -> dict[str, float]:
    """This process's memory in MiB: psutil USS/PSS/RSS and smaps_rollup's anonymous split."""
    import psutil

    full = psutil.Process().memory_full_info()
    out = {"uss": full.uss / MiB, "pss": full.pss / MiB, "rss": full.rss / MiB}
    wanted = ("Anonymous", "Pss_Anon", "Pss_File", "Private_Dirty")
    with open("/proc/self/smaps_rollup") as fh:
        for line in fh:
            parts = line.split()
            if len(parts) >= 3 and parts[0].rstrip(":") in wanted:
                out[parts[0].rstrip(":").lower()] = int(parts[1]) / 1024
    return out


def _libc() -> Any:
    import ctypes

    return ctypes.CDLL("libc.so.6")


class Maker:
    """Creates the sessions of one configuration and keeps alive what they borrow."""

    def __init__(self, config: str, d: Path, extra_mods: tuple[str, ...] = ()) -> None:
        import onnxruntime as ort

        self.ort = ort
        base, *mods = config.split("+")
        self.base, self.mods, self.d = base, {*mods, *extra_mods}, d
        self.buffer: Any = None  # the one memmap every extmem/saved-mem session borrows
        if "globaltp" in self.mods:
            ort.capi._pybind_state.set_global_thread_pool_sizes(1, 1)
        if "mmapthr" in self.mods:
            _libc().mallopt(M_MMAP_THRESHOLD, 128 * 1024)  # fixed: glibc stops raising it
        if "envalloc" in self.mods:
            info = ort.OrtMemoryInfo(
                "Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT
            )
            ort.create_and_register_allocator(info, ort.OrtArenaCfg(0, -1, -1, -1))
        if base == "pool":
            sys.path.insert(0, str(REPO / "src"))
            from sharedml.weights import _prepacked as _prepack

            st = (d / "ext.bin").stat()
            self.prepacked = _prepack.build_prepacked_model(
                d / "ext.onnx",
                d / "ext.bin",
                d / "poolcache",
                # The pool passes its manifest's SHA-256; size + mtime do for a probe.
                weights_digest=f"probe:{st.st_size}:{st.st_mtime_ns}",
            )

    def _borrow(self, so: Any, path: Path) -> None:
        import numpy as np

        if self.buffer is None:
            self.buffer = np.memmap(path, dtype=np.uint8, mode="r")
        so.add_external_initializers_from_files_in_memory(
            [path.name], [self.buffer], [self.buffer.nbytes]
        )
        so.add_session_config_entry("session.use_external_initializer_file_buffers_directly", "1")

    def options(self) -> Any:
        """Fresh SessionOptions with this configuration's modifiers."""
        ort, m = self.ort, self.mods
        so = ort.SessionOptions()
        if self.base.endswith("noprepack") or "noprepack" in m:
            so.add_session_config_entry("session.disable_prepacking", "1")
        if "noarena" in m:
            so.enable_cpu_mem_arena = False
        if "nomempat" in m:
            so.enable_mem_pattern = False
        if "devalloc" in m:
            so.add_session_config_entry("session.use_device_allocator_for_initializers", "1")
        if "envalloc" in m:
            so.add_session_config_entry("session.use_env_allocators", "1")
        if "t1" in m:
            so.intra_op_num_threads = 1
        if "globaltp" in m:
            so.use_per_session_threads = False
        if "ext" in m:
            so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
        return so

    def session(self) -> Any:
        """One new session of this configuration."""
        ort, d, so = self.ort, self.d, self.options()
        path = None
        if self.base.startswith("plain"):
            path = d / "inline.onnx"
        elif self.base.startswith("extfile"):
            path = d / "ext.onnx"
        elif self.base.startswith("extmem"):
            self._borrow(so, d / "ext.bin")
            path = d / "ext.onnx"
        elif self.base in ("saved-file", "saved-mem"):
            if "optall" not in self.mods:
                so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
            if self.base == "saved-mem":
                self._borrow(so, d / "saved" / "opt.bin")
            path = d / "saved" / "opt.onnx"
        elif self.base == "pool":
            self.prepacked.apply(so)
            path = self.prepacked.model_path
        else:
            raise SystemExit(f"unknown configuration {self.base!r}")
        return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def _child_mem(cfg: dict[str, Any]) -> dict[str, Any]:
    import gc

    import numpy as np

    d = Path(cfg["dir"])
    feeds, want = _feeds(d, 1)
    maker = Maker(cfg["config"], d)  # before the baseline: "pool" reads its cache entry here
    gc.collect()
    base = _mem()
    t0 = time.perf_counter()
    sessions = [maker.session() for _ in range(cfg["n"])]
    create_s = time.perf_counter() - t0
    err = 0.0
    for s in sessions:
        for got, ref in zip(s.run(None, feeds), want, strict=True):
            err = max(err, float(np.abs(got.astype(np.float64) - ref).max()))
    gc.collect()
    if "trim" in maker.mods:
        _libc().malloc_trim(0)
    after = _mem()
    _libc().malloc_trim(0)  # what stays once glibc returns the heap pages ORT freed
    trimmed = _mem()
    return {
        "create_s": create_s,
        "max_err": err,
        "maps": sum(1 for line in open("/proc/self/maps") if str(d) in line),
        **{k: after[k] - base[k] for k in after},
        **{f"{k}_trim": trimmed[k] - base[k] for k in trimmed},
    }


def _child_tput(cfg: dict[str, Any]) -> dict[str, Any]:
    import threading

    d, n = Path(cfg["dir"]), cfg["n"]
    feeds, _ = _feeds(d, cfg["batch"])
    maker = Maker(cfg["config"], d, tuple(cfg.get("extra_mods", ())))
    sessions = [maker.session() for _ in range(n)]
    for s in sessions:  # warm up: the first runs size the arena and memory patterns
        for _ in range(2):
            s.run(None, feeds)
    barrier = threading.Barrier(n + 1)
    stop = [float("inf")]
    counts = [0] * n

    def work(i: int) -> None:
        barrier.wait()
        c = 0
        while time.perf_counter() < stop[0]:
            sessions[i].run(None, feeds)
            c += 1
        counts[i] = c

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    barrier.wait()
    t0, c0 = time.perf_counter(), os.times()
    stop[0] = t0 + cfg["seconds"]
    for t in threads:
        t.join()
    elapsed, c1 = time.perf_counter() - t0, os.times()
    cpu_s = (c1.user - c0.user) + (c1.system - c0.system)
    _libc().malloc_trim(0)
    return {
        "runs_per_s": sum(counts) / elapsed,
        "cpu_ms_per_run": 1000 * cpu_s / max(1, sum(counts)),
        "mem": _mem(),
    }


# -------------------------------------------------------------------------------------- driver


def _run_child(cfg: dict[str, Any], timeout_s: int = 300) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, __file__, "_child", json.dumps(cfg)],
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        return {"error": (proc.stderr.strip().splitlines() or ["(no stderr)"])[-1][:300]}
    result: dict[str, Any] = json.loads(lines[-1][len("RESULT ") :])
    return result


def _median_range(values: list[float], fmt: str) -> str:
    v = sorted(values)
    return f"{v[len(v) // 2]:{fmt}} [{v[0]:{fmt}}-{v[-1]:{fmt}}]"


def cmd_mem(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    print(
        "| model | configuration | N | PSS | USS | anon | PSS trimmed | USS trimmed "
        "| anon trimmed | maps | create s | max abs err |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for model in args.models.split(","):
        d = make_models(args.work, model)
        for config in args.configs.split(","):
            for n in (int(v) for v in args.ns.split(",")):
                r = _run_child({"kind": "mem", "dir": str(d), "config": config, "n": n})
                rows.append({"model": model, "config": config, "n": n, **r})
                if "error" in r:
                    print(f"| {model} | {config} | {n} | error: {r['error']} |", flush=True)
                    continue
                print(
                    f"| {model} | {config} | {n} | {r['pss']:.0f} | {r['uss']:.0f} "
                    f"| {r['anonymous']:.0f} | {r['pss_trim']:.0f} | {r['uss_trim']:.0f} "
                    f"| {r['anonymous_trim']:.0f} | {r['maps']} | {r['create_s']:.2f} "
                    f"| {r['max_err']:.1e} |",
                    flush=True,
                )
    return rows


def cmd_tput(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    threads = "intra_op_num_threads=1" if args.t1 else "default intra_op_num_threads"
    print(
        f"{args.n} sessions x {args.n} threads, {threads}, {args.repeat} trials of "
        f"{args.seconds:g} s each, interleaved; median [min-max]"
    )
    print("| model | configuration | batch | runs/s | CPU ms per run | PSS MiB (process) |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for model in args.models.split(","):
        d = make_models(args.work, model)
        configs = args.configs.split(",")
        for batch in (int(v) for v in args.batches.split(",")):
            trials: dict[str, list[dict[str, Any]]] = {c: [] for c in configs}
            for trial in range(args.repeat):
                # Alternate the order, so that drift on this shared VM hits every configuration.
                for config in configs if trial % 2 == 0 else configs[::-1]:
                    cfg = {
                        "kind": "tput",
                        "dir": str(d),
                        "config": config,
                        "n": args.n,
                        "batch": batch,
                        "seconds": args.seconds,
                        "extra_mods": ["t1"] if args.t1 else [],
                    }
                    trials[config].append(_run_child(cfg))
            for config in configs:
                rows.append({"model": model, "config": config, "batch": batch, "trials": trials})
                ok = [r for r in trials[config] if "error" not in r]
                if not ok:
                    print(f"| {model} | {config} | {batch} | error: {trials[config][0]['error']} |")
                    continue
                rate = _median_range([r["runs_per_s"] for r in ok], ".1f")
                cpu = _median_range([r["cpu_ms_per_run"] for r in ok], ".2f")
                pss = ok[0]["mem"]["pss"]
                print(f"| {model} | {config} | {batch} | {rate} | {cpu} | {pss:.0f} |", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_child"]:
        cfg = json.loads(argv[1])
        child = {"make": _child_make, "mem": _child_mem, "tput": _child_tput}[cfg["kind"]]
        print("RESULT " + json.dumps(child(cfg)), flush=True)
        return 0
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("what", choices=["mem", "tput", "models"])
    p.add_argument("--work", type=Path, default=Path("/tmp/sharedml-prepack-probe"))
    p.add_argument("--models", default="mlp200,mlp100")
    p.add_argument("--configs", default=None)
    p.add_argument("--ns", default="1,4,8", help="mem: session counts")
    p.add_argument("--n", type=int, default=4, help="tput: sessions, one thread each")
    p.add_argument("--batches", default="1,8", help="tput: batch sizes")
    p.add_argument("--seconds", type=float, default=3.0, help="tput: length of one trial")
    p.add_argument("--repeat", type=int, default=3, help="tput: trials per configuration")
    p.add_argument(
        "--t1",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="tput: intra_op_num_threads=1 per session",
    )
    p.add_argument("--json", type=Path, default=None, help="also write the raw rows here")
    args = p.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    if args.what == "models":
        for model in args.models.split(","):
            print(make_models(args.work, model))
        return 0
    if args.configs is None:
        args.configs = ",".join(DEFAULT_MEM_CONFIGS if args.what == "mem" else DEFAULT_TPUT_CONFIGS)
    import onnxruntime

    print(f"onnxruntime {onnxruntime.__version__}, {os.cpu_count()} CPUs, PSS/USS/anon in MiB")
    rows = cmd_mem(args) if args.what == "mem" else cmd_tput(args)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

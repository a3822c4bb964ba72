"""Probe which CPU route gives N ONNX Runtime sessions one copy of the weights AND prepacked speed.

Every measurement runs in a fresh subprocess, so one configuration's allocations (or the
page cache it warms in its own mappings) cannot hide or inflate another's.

Memory: growth of the child's USS / PSS (psutil) and of its anonymous memory
(``/proc/self/smaps_rollup``) between "ORT imported, inputs built" and "N sessions created
and each run once". In ONE process, PSS is the honest figure for "how much RAM do these
sessions cost": a page of a file mapped k times in this process counts 1/k per mapping.
USS alone misleads here: a file page mapped by only one mapping is "private" (so one mapped
copy of the weights shows up in USS) while the same page mapped twice is "shared" and
vanishes from USS. ``anon`` is heap memory (private copies that no file backs).

Throughput: 4 sessions, each driven by its own Python thread (Run releases the GIL), all
started together on a barrier; runs/s summed over the threads.

Usage (the figures in docs/cpu-prepacking.md came from these commands)::

    python benchmarks/prepack_probe.py mem                # memory table, both models, N=1,4,8
    python benchmarks/prepack_probe.py tput               # throughput table, 4 sessions x 4 threads
    python benchmarks/prepack_probe.py mem --models mlp200 --ns 8 --configs saved-mem,saved-mem+noarena
    python benchmarks/prepack_probe.py mem --json /tmp/mem.json   # also keep the raw rows

Configurations (``--configs``, comma-separated; ``+modifier`` suffixes combine):

    plain               InferenceSession(model with weights inside the .onnx)
    plain-noprepack     same, session.disable_prepacking=1
    extfile-noprepack   model with one external data file, loaded by path (ORT maps the file)
    extfile-prepack     same, prepacking on
    extmem-noprepack    external data handed over zero-copy: one numpy memmap of the data file,
                        add_external_initializers_from_files_in_memory +
                        session.use_external_initializer_file_buffers_directly=1
    extmem-prepack      same, prepacking on
    saved-file          optimized model saved with session.save_external_prepacked_constant_initializers=1,
                        reloaded by path with graph optimizations off
    saved-mem           same, its data file (raw + prepacked blobs) handed over zero-copy as for extmem
    pool                sharedml._prepack: build_prepacked_model() + PrepackedModel.apply()
                        (what the session pool does)

    modifiers: +noarena (enable_cpu_mem_arena=False), +nomempat (enable_mem_pattern=False),
               +devalloc (session.use_device_allocator_for_initializers=1), +t1 (intra_op_num_threads=1),
               +globaltp (use_per_session_threads=False, global thread pool of 1),
               +envalloc (session.use_env_allocators=1 over a registered shared CPU arena),
               +noprepack (session.disable_prepacking=1), +optall (keep ORT_ENABLE_ALL on reload),
               +trim (glibc malloc_trim(0) after the sessions were created and run, before measuring),
               +mmapthr (mallopt(M_MMAP_THRESHOLD, 128 KiB) before creating sessions)
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
MODELS: dict[str, tuple[int, int]] = {  # name: (layers, width); weights = layers * width^2 * 4 bytes
    "mlp200": (12, 2048),  # 192 MiB of MatMul weights
    "mlp100": (6, 2048),  # 96 MiB
}
DEFAULT_MEM_CONFIGS = (
    "plain",
    "plain-noprepack",
    "extfile-noprepack",
    "extfile-prepack",
    "extmem-noprepack",
    "extmem-prepack",
    "saved-file",
    "saved-mem",
)
DEFAULT_TPUT_CONFIGS = ("plain", "extmem-noprepack", "extmem-prepack", "saved-file")
MiB = 1 << 20


# --------------------------------------------------------------------------- models


def make_models(work: Path, name: str) -> Path:
    """Write <work>/<name>/{inline.onnx, ext.onnx+ext.bin, saved/opt.onnx+opt.bin, ref.npz} once."""
    d = work / name
    if (d / "ref.npz").exists():
        return d
    d.mkdir(parents=True, exist_ok=True)
    # The saved-prepacked model is made by a session, so make everything in a child: the parent
    # stays small and never holds ORT state.
    _run_child({"kind": "make", "dir": str(d), "model": name}, timeout_s=600)
    return d


def _child_make(cfg: dict[str, Any]) -> dict[str, Any]:
    import numpy as np
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    d = Path(cfg["dir"])
    layers, width = MODELS[cfg["model"]]
    rng = np.random.default_rng(0)
    nodes, inits, x = [], [], "x"
    for i in range(layers):
        w = (rng.standard_normal((width, width), dtype=np.float32) / np.sqrt(width)).astype(np.float32)
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
    onnx.save(model, d / "inline.onnx")
    onnx.save(model, d / "ext.onnx", save_as_external_data=True, all_tensors_to_one_file=True,
              location="ext.bin", size_threshold=1024)
    (d / "saved").mkdir(exist_ok=True)
    so = ort.SessionOptions()
    # EXTENDED, not ALL: ORT warns that ALL may write hardware-specific layout ops. (The prepacked
    # blobs are CPU-specific anyway; see sharedml/_prepack.py.)
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    so.optimized_model_filepath = str(d / "saved" / "opt.onnx")
    so.add_session_config_entry("session.optimized_model_external_initializers_file_name", "opt.bin")
    so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    so.add_session_config_entry("session.save_external_prepacked_constant_initializers", "1")
    ort.InferenceSession(str(d / "ext.onnx"), so, providers=["CPUExecutionProvider"])
    xs = {bs: rng.standard_normal((bs, width), dtype=np.float32) for bs in (1, 8)}
    ref = ort.InferenceSession(str(d / "inline.onnx"), providers=["CPUExecutionProvider"])
    np.savez(d / "ref.npz", **{f"x{bs}": v for bs, v in xs.items()},
             **{f"y{bs}": ref.run(None, {"x": v})[0] for bs, v in xs.items()})
    return {"ok": True}


# --------------------------------------------------------------------------- sessions


def _mem() -> dict[str, float]:
    """Memory of this process in MiB: psutil USS/PSS/RSS plus the smaps_rollup split."""
    import psutil

    full = psutil.Process().memory_full_info()
    out = {"uss": full.uss / MiB, "pss": full.pss / MiB, "rss": full.rss / MiB}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 3 and parts[0].rstrip(":") in ("Anonymous", "Pss_Anon", "Pss_File", "Private_Dirty"):
                out[parts[0].rstrip(":").lower()] = int(parts[1]) / 1024
    return out


def _libc() -> Any:
    import ctypes

    return ctypes.CDLL("libc.so.6")


class Maker:
    """Builds sessions for one configuration; keeps whatever buffers must outlive them."""

    def __init__(self, config: str, d: Path) -> None:
        import onnxruntime as ort

        self.ort = ort
        base, *mods = config.split("+")
        self.base, self.mods, self.d = base, set(mods), d
        self.keep: list[Any] = []
        self.shared_buf: Any = None
        if "globaltp" in self.mods:
            ort.capi._pybind_state.set_global_thread_pool_sizes(1, 1)
        if "mmapthr" in self.mods:
            _libc().mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD: fixed, so glibc stops raising it
        if "envalloc" in self.mods:
            mem_info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
            ort.create_and_register_allocator(mem_info, ort.OrtArenaCfg(0, -1, -1, -1))
        if base == "pool":
            sys.path.insert(0, str(REPO))
            from sharedml import _prepack

            self.prepacked = _prepack.build_prepacked_model(
                d / "ext.onnx", d / "ext.bin", d / "poolcache", sess_options=None
            )
            self.keep.append(self.prepacked)

    def _memmap(self, path: Path) -> Any:
        import numpy as np

        if self.shared_buf is None:  # ONE mapping of the file, shared by every session
            self.shared_buf = np.memmap(path, dtype=np.uint8, mode="r")
        return self.shared_buf

    def options(self) -> Any:
        ort = self.ort
        so = ort.SessionOptions()
        m = self.mods
        if self.base.endswith("noprepack") or "noprepack" in m:
            so.add_session_config_entry("session.disable_prepacking", "1")
        if "noarena" in m:
            so.enable_cpu_mem_arena = False
        if "nomempat" in m:
            so.enable_mem_pattern = False
        if "devalloc" in m:
            so.add_session_config_entry("session.use_device_allocator_for_initializers", "1")
        if "t1" in m or "t1" in getattr(self, "extra_mods", ()):
            so.intra_op_num_threads = 1
        if "globaltp" in m:
            so.use_per_session_threads = False
        if "envalloc" in m:
            so.add_session_config_entry("session.use_env_allocators", "1")
        return so

    def session(self) -> Any:
        ort, d = self.ort, self.d
        so = self.options()
        prov = ["CPUExecutionProvider"]
        if self.base.startswith("plain"):
            return ort.InferenceSession(str(d / "inline.onnx"), so, providers=prov)
        if self.base.startswith("extfile"):
            return ort.InferenceSession(str(d / "ext.onnx"), so, providers=prov)
        if self.base.startswith("extmem"):
            buf = self._memmap(d / "ext.bin")
            so.add_external_initializers_from_files_in_memory(["ext.bin"], [buf], [buf.nbytes])
            so.add_session_config_entry("session.use_external_initializer_file_buffers_directly", "1")
            return ort.InferenceSession(str(d / "ext.onnx"), so, providers=prov)
        if self.base.startswith("saved"):
            if "optall" not in self.mods:
                so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
            if self.base == "saved-mem":
                buf = self._memmap(d / "saved" / "opt.bin")
                so.add_external_initializers_from_files_in_memory(["opt.bin"], [buf], [buf.nbytes])
                so.add_session_config_entry("session.use_external_initializer_file_buffers_directly", "1")
            return ort.InferenceSession(str(d / "saved" / "opt.onnx"), so, providers=prov)
        if self.base == "pool":
            self.prepacked.apply(so)
            return ort.InferenceSession(str(self.prepacked.model_path), so, providers=prov)
        raise SystemExit(f"unknown configuration {self.base!r}")


def _child_mem(cfg: dict[str, Any]) -> dict[str, Any]:
    import gc

    import numpy as np

    d = Path(cfg["dir"])
    ref = np.load(d / "ref.npz")
    x, y = ref["x1"], ref["y1"]
    gc.collect()
    base = _mem()
    maker = Maker(cfg["config"], d)
    t0 = time.perf_counter()
    sessions = [maker.session() for _ in range(cfg["n"])]
    create_s = time.perf_counter() - t0
    err = 0.0
    for s in sessions:
        err = max(err, float(np.abs(s.run(None, {"x": x})[0] - y).max()))
    gc.collect()
    if "trim" in maker.mods:
        _libc().malloc_trim(0)
    after = _mem()
    # Then what is left once glibc gives back the heap pages that ORT freed during session
    # creation (it keeps them by default; see docs/cpu-prepacking.md). Reading this second
    # figure changes no ORT state, so both come from the same sessions.
    _libc().malloc_trim(0)
    trimmed = _mem()
    return {"create_s": create_s, "max_err": err, **{k: after[k] - base[k] for k in after},
            **{f"{k}_trim": trimmed[k] - base[k] for k in trimmed}}


def _child_tput(cfg: dict[str, Any]) -> dict[str, Any]:
    import threading

    import numpy as np

    d = Path(cfg["dir"])
    ref = np.load(d / "ref.npz")
    x = ref[f"x{cfg['batch']}"]
    maker = Maker(cfg["config"], d)
    maker.extra_mods = set(cfg.get("extra_mods", ()))
    n = cfg["n"]
    sessions = [maker.session() for _ in range(n)]
    for s in sessions:  # warm up: first runs allocate the arena / memory pattern
        for _ in range(2):
            s.run(None, {"x": x})
    barrier = threading.Barrier(n + 1)
    stop = time.perf_counter() + 1e9
    counts = [0] * n

    def work(i: int) -> None:
        s = sessions[i]
        barrier.wait()
        c = 0
        while time.perf_counter() < stop:
            s.run(None, {"x": x})
            c += 1
        counts[i] = c

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    stop = time.perf_counter() + 1e9
    barrier.wait()
    t0 = time.perf_counter()
    stop = t0 + cfg["seconds"]
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    _libc().malloc_trim(0)
    return {"runs_per_s": sum(counts) / elapsed, "mem": _mem()}


# --------------------------------------------------------------------------- driver


def _run_child(cfg: dict[str, Any], timeout_s: int = 300) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, __file__, "_child", json.dumps(cfg)],
        capture_output=True, text=True, timeout=timeout_s,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        return {"error": (proc.stderr.strip().splitlines() or ["(no stderr)"])[-1][:300]}
    result: dict[str, Any] = json.loads(lines[-1][len("RESULT "):])
    return result


def cmd_mem(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    print("| model | configuration | N | PSS MiB | USS MiB | anon MiB | PSS after trim | USS after trim "
          "| anon after trim | create s | max abs err |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for model in args.models.split(","):
        d = make_models(args.work, model)
        for config in args.configs.split(","):
            for n in (int(v) for v in args.ns.split(",")):
                r = _run_child({"kind": "mem", "dir": str(d), "config": config, "n": n})
                rows.append({"model": model, "config": config, "n": n, **r})
                if "error" in r:
                    print(f"| {model} | {config} | {n} | error: {r['error']} ||||||||", flush=True)
                    continue
                print(f"| {model} | {config} | {n} | {r['pss']:.0f} | {r['uss']:.0f} | {r['anonymous']:.0f} "
                      f"| {r['pss_trim']:.0f} | {r['uss_trim']:.0f} | {r['anonymous_trim']:.0f} "
                      f"| {r['create_s']:.2f} | {r['max_err']:.1e} |", flush=True)
    return rows


def cmd_tput(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    threads_note = "intra_op_num_threads=1" if args.t1 else "intra_op_num_threads default"
    print(f"{args.n} sessions x {args.n} threads, {args.seconds:g} s per trial, {args.repeat} trials "
          f"(configurations interleaved), {threads_note}; runs/s summed over threads: median [min-max]")
    print("| model | configuration | batch | runs/s | PSS MiB, whole process, after trim |")
    print("| --- | --- | ---: | ---: | ---: |")
    for model in args.models.split(","):
        d = make_models(args.work, model)
        for batch in (int(v) for v in args.batches.split(",")):
            configs = args.configs.split(",")
            results: dict[str, list[dict[str, Any]]] = {c: [] for c in configs}
            for trial in range(args.repeat):
                # Interleave, so that drift of this shared 2-core VM hits every configuration alike.
                for config in configs if trial % 2 == 0 else configs[::-1]:
                    results[config].append(_run_child({
                        "kind": "tput", "dir": str(d), "config": config, "n": args.n, "batch": batch,
                        "seconds": args.seconds, "extra_mods": ["t1"] if args.t1 else []}))
            for config in configs:
                ok = [r for r in results[config] if "error" not in r]
                rows.append({"model": model, "config": config, "batch": batch, "trials": results[config]})
                if not ok:
                    print(f"| {model} | {config} | {batch} | error: {results[config][0]['error']} ||", flush=True)
                    continue
                rates = sorted(r["runs_per_s"] for r in ok)
                med = rates[len(rates) // 2]
                print(f"| {model} | {config} | {batch} | {med:.1f} [{rates[0]:.1f}-{rates[-1]:.1f}] "
                      f"| {ok[0]['mem']['pss']:.0f} |", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_child"]:
        cfg = json.loads(argv[1])
        fn = {"make": _child_make, "mem": _child_mem, "tput": _child_tput}[cfg["kind"]]
        print("RESULT " + json.dumps(fn(cfg)), flush=True)
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["mem", "tput", "models"])
    p.add_argument("--work", type=Path, default=Path("/tmp/sharedml-prepack-probe"), help="model/cache folder")
    p.add_argument("--models", default="mlp200,mlp100")
    p.add_argument("--configs", default=None)
    p.add_argument("--ns", default="1,4,8", help="mem: session counts")
    p.add_argument("--n", type=int, default=4, help="tput: sessions (one thread each)")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--seconds", type=float, default=3.0, help="tput: length of one trial")
    p.add_argument("--repeat", type=int, default=3, help="tput: trials per configuration")
    p.add_argument("--t1", action=argparse.BooleanOptionalAction, default=True,
                   help="tput: intra_op_num_threads=1 per session (4 threads already oversubscribe 2 cores)")
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

    print(f"onnxruntime {onnxruntime.__version__}, {os.cpu_count()} CPUs")
    rows = cmd_mem(args) if args.what == "mem" else cmd_tput(args)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

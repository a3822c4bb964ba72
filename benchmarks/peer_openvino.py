r"""sharedml against OpenVINO on the CPU: C callers sending one row at a time, side by side.

OpenVINO is what a CPU user would pick instead of sharedml, so this is the comparison that
says whether sharedml is worth it on a CPU. For every model, caller count C and configuration,
in a fresh process each, C callers in a closed loop (each sends its next one-row request as
soon as the last one returned; ``serving.closed_loop``, requests counted where they complete)
run against one server:

``pool:...``             a ``sharedml.SessionPool``, named as in ``benchmarks/serving.py``
                         (``pool:2:batch``: 2 sessions, batching on; its docstring lists the
                         flags). ``plain:...`` configurations run too if named, for context,
                         but never count as sharedml. ``pool:...:int8`` / ``:int4``
                         (compressed weights) and ``:static`` (int8 weights and
                         activations, ``sharedml.prepared.compress_static`` calibrated on
                         16 generated inputs the measured requests never repeat) compete in
                         classes of their own, against OpenVINO's reduced precisions: their
                         outputs differ by design.
``ov:PRECISION[:...]``   OpenVINO: one compiled model on ``CPU``, one infer request per caller
                         (``:reqN``: N of them, shared through a queue), the ``THROUGHPUT``
                         performance hint (``:latency``: ``LATENCY``). ``PRECISION`` is ``f32``
                         (``INFERENCE_PRECISION_HINT=f32``), ``default`` (no hint: what
                         OpenVINO picks for this CPU, bf16 where the CPU has AMX or
                         AVX-512-BF16; the compiled model's choice is recorded), or ``bf16`` /
                         ``f16`` explicitly. The model is reshaped to the one-row shapes the
                         callers send, as an OpenVINO user serving fixed shapes does
                         (``:dynamic`` keeps the exported dynamic shapes).

``:latency`` configurations run only with one caller: with several, OpenVINO's own advice is
the throughput hint, and one stream would only queue them.

Every configuration's process imports its runtime, runs one throwaway inference (the runtime's
one-time costs), records its PSS/USS (``psutil``), creates its server (timed), runs every caller
once, then the window: ``--warmup-s`` then ``--duration-s``. Recorded: requests/s, p50/p99
latency, PSS/USS growth at the end of the window (every server's weights and activations
alive), CPU seconds the process got per second, the load average at its start and end, and
every output of the first request of each caller and of every 16th request after it compared
with a plain ``onnxruntime.InferenceSession`` (ORT's defaults: float32) on the same input:
largest absolute difference, and relative to that output's largest reference value.

Rounds are interleaved: every (model, callers, configuration) runs once per round, the
configurations' order rotated from round to round, so that a noisy minute of a shared machine
hits them all. The table: within each round, the best sharedml configuration's requests/s over
the best OpenVINO configuration's of one precision class; the median of the rounds (with their
range). A sharedml configuration whose outputs differ from the reference never counts as best;
OpenVINO's do (a reduced precision differs by design: the differences are in the table).

Usage::

    pip install -e '.[peer]'      # openvino, a benchmark-only dependency
    python benchmarks/peer_openvino.py --quick --json /tmp/peer-quick.json   # smoke run
    python benchmarks/peer_openvino.py --model /path/to/transformer.onnx \\
        --json benchmarks/results/peer-openvino.json
    python benchmarks/peer_openvino.py --render benchmarks/results/peer-openvino.json

``--model PATH`` adds a real ONNX file (downloaded beforehand, never at run time); its symbolic
axis 0 is fed one row and any other symbolic axis ``--seq``. ``--json FILE`` also writes
``FILE`` with an ``.md`` suffix (the tables); the JSON is rewritten after every round, so an
interrupted run keeps what it measured.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import queue
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

SCRIPT = Path(__file__).resolve()
HERE = SCRIPT.parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

import _harness  # noqa: E402  (sibling files, not a package)
import run  # noqa: E402
import serving  # noqa: E402

SCHEMA = "sharedml-peer-openvino/1"
MIB = 1 << 20
CPU = ["CPUExecutionProvider"]
SHAREDML_CONFIGS = ["pool:1", "pool:2", "pool:1:batch", "pool:2:batch"]
OV_CONFIGS = ["ov:f32", "ov:default", "ov:f32:latency", "ov:default:latency"]
OV_PRECISIONS = ("f32", "default", "bf16", "f16")
FULL: dict[str, Any] = {
    "models": ["mlp", "resnet", "bert"],
    "size": "full",
    "callers": [1, 4, 16],
    "rounds": 4,
    "warmup_s": 0.5,
    "duration_s": 3.0,
    "configs": SHAREDML_CONFIGS,
    "ov_configs": OV_CONFIGS,
}
QUICK: dict[str, Any] = {
    "models": ["mlp", "resnet", "bert"],
    "size": "tiny",
    "callers": [1, 4],
    "rounds": 1,
    "warmup_s": 0.1,
    "duration_s": 0.3,
    "configs": ["pool:1", "pool:2:batch"],
    "ov_configs": ["ov:f32", "ov:default"],
}
LABELS = {"mlp": "MLP", "resnet_like": "ResNet-50-like", "bert_like": "BERT-like"}


# --------------------------------------------------------------------------------------------
# Configurations


def parse_ov_config(name: str) -> dict[str, Any]:
    """``ov:PRECISION[:latency][:reqN][:dynamic]`` -> its settings (see the module docstring).

    Raises:
        SystemExit: A name that is not such a configuration.
    """
    parts = name.split(":")
    if len(parts) < 2 or parts[0] != "ov" or parts[1] not in OV_PRECISIONS:
        raise SystemExit(
            f"unknown OpenVINO configuration {name!r}: expected ov:PRECISION[:flags], "
            f"PRECISION one of {', '.join(OV_PRECISIONS)}"
        )
    settings: dict[str, Any] = {
        "precision": parts[1],
        "hint": "THROUGHPUT",
        "requests": None,
        "static": True,
    }
    for flag in parts[2:]:
        if flag == "latency":
            settings["hint"] = "LATENCY"
        elif flag == "dynamic":
            settings["static"] = False
        elif flag.startswith("req") and flag[3:].isdigit() and int(flag[3:]) > 0:
            settings["requests"] = int(flag[3:])
        else:
            raise SystemExit(f"unknown flag {flag!r} in OpenVINO configuration {name!r}")
    return settings


COMPRESSED = ("int8", "int4", "static")


def family(config: str) -> str:
    """What a configuration competes as: ``sharedml``, ``plain`` or ``ov:PRECISION``.

    Pools with compressed weights compete as ``sharedml:int8`` / ``sharedml:int4``.
    """
    if config.startswith("ov:"):
        return f"ov:{parse_ov_config(config)['precision']}"
    parsed = serving._parse_config(config)
    if parsed["kind"] != "pool":
        return "plain"
    weights = [w for w in COMPRESSED if w in parsed["flags"]]
    return f"sharedml:{weights[0]}" if weights else "sharedml"


def configs_for(callers: int, configs: Sequence[str], ov_configs: Sequence[str]) -> list[str]:
    """The configurations run at ``callers``: ``:latency`` ones only with one caller."""
    ov = [c for c in ov_configs if callers == 1 or parse_ov_config(c)["hint"] != "LATENCY"]
    return [*configs, *ov]


def _rotated(items: list[str], k: int) -> list[str]:
    k %= max(1, len(items))
    return items[k:] + items[:k]


# --------------------------------------------------------------------------------------------
# The child: one configuration


class _OpenVINOServer:
    """One compiled model; callers take an infer request from a queue for each request."""

    def __init__(self, compiled: Any, requests: int) -> None:
        self._free: queue.Queue[Any] = queue.Queue()
        for _ in range(requests):
            self._free.put(compiled.create_infer_request())
        self._compiled = compiled

    def run(self, feed: dict[str, Any]) -> list[Any]:
        request = self._free.get()
        try:
            # infer() releases the GIL and copies the outputs out (share_outputs=False).
            return list(request.infer(feed).to_tuple())
        finally:
            self._free.put(request)

    def close(self) -> None:
        while not self._free.empty():
            self._free.get_nowait()
        self._compiled = None


OV_PROPERTIES = (
    "INFERENCE_PRECISION_HINT",
    "PERFORMANCE_HINT",
    "NUM_STREAMS",
    "INFERENCE_NUM_THREADS",
    "OPTIMAL_NUMBER_OF_INFER_REQUESTS",
)


def _ov_server(
    core: Any, spec: dict[str, Any], shapes: dict[str, list[int]]
) -> tuple[_OpenVINOServer, dict[str, Any]]:
    settings = parse_ov_config(spec["config"])
    model = core.read_model(spec["model"])
    if settings["static"]:
        model.reshape(shapes)
    config = {"PERFORMANCE_HINT": settings["hint"]}
    if settings["precision"] != "default":
        config["INFERENCE_PRECISION_HINT"] = settings["precision"]
    compiled = core.compile_model(model, "CPU", config)
    del model  # what a server keeps is the compiled model
    gc.collect()
    requests = settings["requests"] or spec["callers"]
    chosen: dict[str, Any] = {"infer_requests": requests, "static_shapes": settings["static"]}
    for key in OV_PROPERTIES:
        try:
            chosen[key.lower()] = _ov_text(compiled.get_property(key))
        except RuntimeError:
            chosen[key.lower()] = None
    return _OpenVINOServer(compiled, requests), chosen


def _ov_text(value: Any) -> str:
    """An OpenVINO property as plain text: ``f32`` for a type, ``THROUGHPUT`` for a mode."""
    if hasattr(value, "get_type_name"):  # openvino.Type
        return str(value.get_type_name())
    return str(getattr(value, "name", value))  # enums (PerformanceMode) have a name


def _ov_throwaway(core: Any) -> None:
    """OpenVINO's one-time costs (the CPU plugin, its thread pools) before the baseline."""
    import numpy as np
    import openvino as ov
    import openvino.opset13 as ops

    param = ops.parameter([1, 8], ov.Type.f32)
    compiled = core.compile_model(ov.Model([ops.relu(param)], [param]), "CPU")
    compiled.create_infer_request().infer({0: np.ones((1, 8), np.float32)})


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Measure one configuration once; see the module docstring.

    Args:
        spec: ``model``, ``references`` (``serving.references``' file), ``config``,
            ``callers``, ``warmup_s``, ``duration_s``, ``cache_dir``, ``providers``.

    Returns:
        The measurements.
    """
    import numpy as np

    result: dict[str, Any] = {"loadavg_start": list(os.getloadavg())}
    refs = np.load(spec["references"], allow_pickle=False)
    feeds = [
        {k[len(f"in{i}_") :]: refs[k] for k in refs.files if k.startswith(f"in{i}_")}
        for i in range(serving.INPUTS)
    ]
    outputs = sum(1 for k in refs.files if k.startswith("out0_"))
    expected = [[refs[f"out{i}_{j}"] for j in range(outputs)] for i in range(serving.INPUTS)]
    openvino = spec["config"].startswith("ov:")
    core = None
    if openvino:
        import openvino as ov

        core = ov.Core()
        _ov_throwaway(core)
    else:
        _harness._throwaway_session()
    gc.collect()
    base = _harness._memory()

    start = time.perf_counter()
    server: Any
    if core is not None:
        shapes = {name: list(value.shape) for name, value in feeds[0].items()}
        server, extras = _ov_server(core, spec, shapes)
    else:
        server, extras = serving._server(spec)
    result["create_s"] = time.perf_counter() - start
    start = time.perf_counter()
    if hasattr(server, "warm_up"):
        server.warm_up(feeds[0])
    result["warm_up_s"] = time.perf_counter() - start
    result["after_create"] = _harness._memory()

    checks = _harness._Checks(rtol=serving.RTOL, atol=serving.ATOL)
    pooled = hasattr(server, "stats")
    marks: dict[str, Any] = {}

    def at_start() -> None:
        marks["cpu0"] = _harness._cpu_seconds()
        if pooled:
            marks["stats0"] = server.stats()

    def at_end() -> None:
        marks["cpu1"] = _harness._cpu_seconds()
        marks["memory"] = _harness._memory()  # every request's buffers still alive
        if pooled:
            marks["stats1"] = server.stats()

    window = serving.closed_loop(
        server.run,
        feeds,
        spec["callers"],
        warmup_s=spec["warmup_s"],
        duration_s=spec["duration_s"],
        check=lambda c, i, out: checks.add(list(out), expected[i]),
        at_start=at_start,
        at_end=at_end,
    )
    elapsed = window.end - window.start
    result.update(window.summary())
    result["cpu_per_s"] = (marks["cpu1"] - marks["cpu0"]) / elapsed
    if pooled:
        s0, s1 = marks["stats0"], marks["stats1"]
        batches = s1.batches - s0.batches
        rows = s1.batched_rows - s0.batched_rows
        result["window_batches"] = batches
        result["mean_batch_rows"] = rows / batches if batches else None  # in the window
    server.close()
    result.update(checks.as_dict())
    result["output_scale"] = max(float(np.max(np.abs(e), initial=0.0)) for e in expected[0])
    for key in ("pss_mib", "uss_mib", "rss_mib"):
        result[key] = marks["memory"][key] - base[key]
        result[f"{key[:-4]}_after_create_mib"] = result["after_create"][key] - base[key]
    result["baseline"] = base
    result["extras"] = extras
    result["loadavg_end"] = list(os.getloadavg())
    return result


def warm(spec: dict[str, Any]) -> dict[str, Any]:
    """Fill sharedml's cache for every pool configuration, so no measured one prepares."""
    seconds = {}
    for config in spec["configs"]:
        start = time.perf_counter()
        server, _ = serving._server({**spec, "config": config})
        server.close()
        seconds[config] = time.perf_counter() - start
    return {"seconds": seconds}


# --------------------------------------------------------------------------------------------
# Summaries (pure: the tests drive them with synthetic results)


def _best(rows: list[dict[str, Any]], klass: str) -> dict[str, Any] | None:
    """The fastest usable row of a class; a float sharedml row must match the reference.

    Compressed weights differ by design, as OpenVINO's reduced precisions do.
    """
    usable = [
        r
        for r in rows
        if r["family"] == klass
        and "error" not in r
        and r.get("requests_per_s")
        and (klass != "sharedml" or r.get("outputs_equal"))
    ]
    return max(usable, key=lambda r: float(r["requests_per_s"]), default=None)


def _ov_classes(rows: list[dict[str, Any]]) -> list[str]:
    """The OpenVINO precision classes among the rows, in ``OV_PRECISIONS`` order."""
    seen = {r["family"] for r in rows if r["family"].startswith("ov:")}
    return [f"ov:{p}" for p in OV_PRECISIONS if f"ov:{p}" in seen]


def _spread(values: list[float]) -> dict[str, Any] | None:
    if not values:
        return None
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "rounds": values,
    }


def summarize(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per model: best sharedml over best OpenVINO of each precision, per round, and per config.

    Args:
        results: Worker results, each with ``model``, ``round``, ``callers``, ``config`` and
            ``family`` added (:func:`family`).

    Returns:
        One entry per model, in first-seen order: ``ratios[callers][ov_class]`` and
        ``memory[ov_class]`` (PSS of the best sharedml configuration over the best OpenVINO
        one's, at the most callers) as ``{median, min, max, rounds}`` or None, the precision
        each OpenVINO class ran at, and ``configs``: each configuration's medians over rounds.
    """
    models = list(dict.fromkeys(r["model"] for r in results))
    summary = []
    for model in models:
        mine = [r for r in results if r["model"] == model]
        callers_seen = sorted({int(r["callers"]) for r in mine})
        ov_classes = _ov_classes(mine)
        rounds = sorted({int(r["round"]) for r in mine})
        ratios, memory = _against(mine, "sharedml", callers_seen, ov_classes, rounds)
        compressed = {}
        for weights in COMPRESSED:
            rows = [r for r in mine if r["family"] == f"sharedml:{weights}"]
            if rows:
                c_ratios, c_memory = _against(
                    mine, f"sharedml:{weights}", callers_seen, ov_classes, rounds
                )
                diffs = [
                    float(r["max_rel_diff"]) for r in rows if r.get("max_rel_diff") is not None
                ]
                compressed[weights] = {
                    "ratios": c_ratios,
                    "memory": c_memory,
                    "max_rel_diff": max(diffs, default=None),
                }
        precisions = {
            klass: sorted(
                {
                    str(r.get("extras", {}).get("inference_precision_hint"))
                    for r in mine
                    if r["family"] == klass and "error" not in r
                }
            )
            for klass in ov_classes
        }
        summary.append(
            {
                "model": model,
                "callers": callers_seen,
                "memory_callers": callers_seen[-1] if callers_seen else None,
                "ratios": ratios,
                "memory": memory,
                "compressed": compressed,
                "ov_precisions": precisions,
                "configs": _per_config(mine),
            }
        )
    return summary


def _against(
    rows: list[dict[str, Any]],
    mine: str,
    callers_seen: list[int],
    ov_classes: list[str],
    rounds: list[int],
) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """``mine``'s best over each OpenVINO class's best, per round.

    Requests/s at every caller count; PSS at the most callers.
    """
    ratios: dict[str, dict[str, Any]] = {}
    memory: dict[str, Any] = {}
    for callers in callers_seen:
        ratios[str(callers)] = {}
        for klass in ov_classes:
            per_round, memory_round = [], []
            for k in rounds:
                here = [r for r in rows if r["callers"] == callers and r["round"] == k]
                best, ov = _best(here, mine), _best(here, klass)
                if best is None or ov is None:
                    continue
                per_round.append(best["requests_per_s"] / ov["requests_per_s"])
                if ov.get("pss_mib"):
                    memory_round.append(best["pss_mib"] / ov["pss_mib"])
            ratios[str(callers)][klass] = _spread(per_round)
            if callers == callers_seen[-1]:
                memory[klass] = _spread(memory_round)
    return ratios, memory


def _per_config(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    keys = list(dict.fromkeys((int(r["callers"]), r["config"]) for r in rows))
    out = []
    for callers, config in sorted(keys, key=lambda k: k[0]):
        runs = [r for r in rows if r["callers"] == callers and r["config"] == config]
        ok = [r for r in runs if "error" not in r]

        def median(key: str, ok: list[dict[str, Any]] = ok) -> float | None:
            values = [float(r[key]) for r in ok if r.get(key) is not None]
            return statistics.median(values) if values else None

        out.append(
            {
                "callers": callers,
                "config": config,
                "family": runs[0]["family"],
                "runs": len(runs),
                "errors": [r["error"] for r in runs if "error" in r],
                "requests_per_s": median("requests_per_s"),
                "p50_ms": median("p50_ms"),
                "p99_ms": median("p99_ms"),
                "pss_mib": median("pss_mib"),
                "uss_mib": median("uss_mib"),
                "cpu_per_s": median("cpu_per_s"),
                "mean_batch_rows": median("mean_batch_rows"),
                "outputs_equal": all(r.get("outputs_equal") for r in ok) if ok else None,
                "max_abs_diff": max((r["max_abs_diff"] for r in ok), default=None),
                "max_rel_diff": max((r["max_rel_diff"] for r in ok), default=None),
                "precision": next(
                    (r["extras"].get("inference_precision_hint") for r in ok if r.get("extras")),
                    None,
                ),
                "streams": next(
                    (r["extras"].get("num_streams") for r in ok if r.get("extras")), None
                ),
            }
        )
    return out


def _x(spread: dict[str, Any] | None) -> str:
    if spread is None:
        return "n/a"
    if len(spread["rounds"]) == 1:
        return f"{spread['median']:.2f}x"
    return f"{spread['median']:.2f}x ({spread['min']:.2f}-{spread['max']:.2f})"


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _label(model: str, weights_bytes: int | None) -> str:
    base = model.rsplit("-", 1)[0] if model.endswith(("-full", "-tiny")) else model
    name = LABELS.get(base, base)
    if model.endswith("-tiny"):
        name += " (tiny)"
    return f"{name}, {weights_bytes / MIB:.0f} MiB" if weights_bytes else name


def _class_label(klass: str, precisions: list[str]) -> str:
    label = "OV " + klass.split(":", 1)[1]
    shown = [p for p in precisions if p != "None"]
    return f"{label} ({'/'.join(shown)})" if klass == "ov:default" and shown else label


def render_markdown(doc: dict[str, Any]) -> str:
    """The report's tables (Markdown) from its JSON document."""
    machine = doc.get("machine", {})
    settings = doc.get("settings", {})
    lines = [
        "# sharedml against OpenVINO on the CPU",
        "",
        f"`{doc.get('command', '')}`",
        "",
        f"{machine.get('cpu_model', '?')}, {_cores(machine)} "
        f"(CPU flags: {', '.join(machine.get('cpu_flags', [])) or 'none of interest'}); "
        f"onnxruntime {machine.get('onnxruntime')}, openvino {machine.get('openvino')}, "
        f"sharedml at {str(machine.get('git_commit'))[:10]}"
        f"{' (uncommitted changes)' if machine.get('git_dirty') else ''}. "
        f"{_rounds(settings.get('rounds'))}, {settings.get('warmup_s')} s warm-up + "
        f"{settings.get('duration_s')} s window per configuration, a fresh process each; "
        f"took {_num(doc.get('wall_s', 0) / 60)} min.",
    ]
    loads = [r["loadavg_start"][0] for r in doc.get("results", []) if "loadavg_start" in r]
    if loads:
        lines.append(
            f"Load average (1 min) at the start of each process: median "
            f"{statistics.median(loads):.1f}, range {min(loads):.1f}-{max(loads):.1f}."
        )
    weights = {m["name"]: m.get("weights_bytes") for m in doc.get("models", [])}
    lines += [
        "",
        "Best sharedml configuration's requests/s over the best OpenVINO configuration's, "
        "within each round; median of rounds (range). Memory: PSS growth of the best "
        "sharedml configuration over the best OpenVINO configuration's, at the most callers.",
        "",
    ]
    summary = doc.get("summary", [])
    classes = _ov_classes([{"family": k} for s in summary for k in s["memory"]])
    callers = sorted({c for s in summary for c in s["callers"]}, reverse=True)
    precisions: dict[str, list[str]] = {}
    for s in summary:
        for klass, seen in s["ov_precisions"].items():
            precisions[klass] = sorted(set(precisions.get(klass, [])) | set(seen))
    header = ["model"]
    for c in callers:
        for klass in classes:
            noun = "caller" if c == 1 else "callers"
            header.append(f"{c} {noun} vs {_class_label(klass, precisions.get(klass, []))}")
    header += [f"memory vs {_class_label(k, precisions.get(k, []))}" for k in classes]
    lines.append("| " + " | ".join(header) + " |")
    lines.append("| --- |" + " ---: |" * (len(header) - 1))
    for s in summary:
        row = [_label(s["model"], weights.get(s["model"]))]
        for c in callers:
            for klass in classes:
                row.append(_x(s["ratios"].get(str(c), {}).get(klass)))
        row += [_x(s["memory"].get(k)) for k in classes]
        lines.append("| " + " | ".join(row) + " |")
    if any(s.get("compressed") for s in summary):
        lines += [
            "",
            "Compressed weights (`SessionPool(weights=...)`): the best such configuration over "
            "the best OpenVINO one, as above. Their outputs differ from float32 by design: the "
            "last column is the largest difference relative to the output's scale.",
            "",
            "| " + " | ".join([*header[:1], "weights", *header[1:], "max rel diff"]) + " |",
            "| --- | --- |" + " ---: |" * len(header),
        ]
        for s in summary:
            for kind, c in s.get("compressed", {}).items():
                row = [_label(s["model"], weights.get(s["model"])), kind]
                row += [
                    _x(c["ratios"].get(str(n), {}).get(klass)) for n in callers for klass in classes
                ]
                row += [_x(c["memory"].get(k)) for k in classes] + [_sci(c["max_rel_diff"])]
                lines.append("| " + " | ".join(row) + " |")
    for s in summary:
        lines += [
            "",
            f"## {_label(s['model'], weights.get(s['model']))}",
            "",
            "Medians over rounds. Outputs: every checked request against plain ORT float32; "
            "largest difference relative to the output's scale.",
            "",
            "| callers | configuration | req/s | p50 ms | p99 ms | PSS MiB | USS MiB | "
            "CPU s/s | rows/batch | OV precision, streams | outputs (max rel diff) |",
            "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |",
        ]
        for c in s["configs"]:
            if c["errors"] and c["requests_per_s"] is None:
                lines.append(f"| {c['callers']} | {c['config']} | FAILED: {c['errors'][0]} |")
                continue
            same = "equal" if c["outputs_equal"] else "DIFFER"
            ov = c["precision"] or ""
            if c["streams"] is not None:
                ov += f", {c['streams']} streams"
            lines.append(
                f"| {c['callers']} | {c['config']} | {_num(c['requests_per_s'])} | "
                f"{_num(c['p50_ms'], 2)} | {_num(c['p99_ms'], 2)} | {_num(c['pss_mib'], 0)} | "
                f"{_num(c['uss_mib'], 0)} | {_num(c['cpu_per_s'], 2)} | "
                f"{_num(c['mean_batch_rows'])} | {ov} | "
                f"{same} ({_sci(c['max_rel_diff'])}) |"
            )
    return "\n".join(lines) + "\n"


def _cores(machine: dict[str, Any]) -> str:
    logical, usable = machine.get("logical_cores", "?"), machine.get("usable_cores")
    if usable is None or usable == logical:
        return f"{logical} cores"
    return f"{usable} of its {logical} cores (the process's affinity mask)"


def _rounds(n: Any) -> str:
    return "1 round" if n == 1 else f"{n} interleaved rounds"


def _sci(value: float | None) -> str:
    return "-" if value is None else f"{value:.1e}"


# --------------------------------------------------------------------------------------------
# The parent


def _cpu_flags() -> list[str]:
    """The CPU features that decide OpenVINO's default precision, where present."""
    wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_fp16")
    flags: set[str] = set()
    for line in run._read("/proc/cpuinfo").splitlines():
        if line.startswith("flags"):
            flags |= set(line.split(":", 1)[1].split())
    return [f for f in wanted if f in flags]


def _machine() -> dict[str, Any]:
    """run.py's machine description, plus what decides OpenVINO's choices."""
    info = run._machine()
    info["openvino"] = run._version("openvino")
    info["cpu_flags"] = _cpu_flags()
    info["usable_cores"] = len(os.sched_getaffinity(0))  # the affinity mask: taskset narrows it
    try:
        import openvino as ov

        info["openvino_cpu_capabilities"] = list(
            ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")
        )
    except Exception as exc:  # recorded, not fatal: the workers will say what fails
        info["openvino_cpu_capabilities"] = f"unavailable: {exc}"
    return info


def _have_openvino() -> bool:
    try:
        import openvino  # noqa: F401
    except ImportError:
        return False
    return True


def _write(doc: dict[str, Any], path: Path | None) -> None:
    doc["summary"] = summarize(doc["results"])
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    path.with_suffix(".md").write_text(render_markdown(doc))


def _line(model: str, r: dict[str, Any]) -> str:
    head = f"r{r['round']} {model} {r['config']:<22} x{r['callers']:<3}"
    if "error" in r:
        return f"{head} FAILED {r['error']}"
    rows = f", {r['mean_batch_rows']:.1f} rows/batch" if r.get("mean_batch_rows") else ""
    extras = r.get("extras", {})
    ov = f", {extras['inference_precision_hint']}" if "inference_precision_hint" in extras else ""
    if "calibration" in extras:  # sessions="auto": the split it chose
        ov += f", auto: {extras['calibration']['sessions']}x{extras['calibration']['threads']}"
    p50 = "-" if r.get("p50_ms") is None else f"{r['p50_ms']:.2f}"
    return (
        f"{head} {r['requests_per_s']:8.1f} req/s  p50 {p50} ms  PSS {r['pss_mib']:6.0f} MiB"
        f"{ov}{rows}, outputs {'equal' if r['outputs_equal'] else 'differ'} "
        f"(max rel diff {r['max_rel_diff']:.1e}), load {r['loadavg_start'][0]:.1f}"
    )


def _eta(doc: dict[str, Any], processes: int) -> str:
    """`` [n/N, ~M min left]``, from the processes so far."""
    done = doc["results"]
    mean_s = statistics.mean(r["process_s"] for r in done)
    return f" [{len(done)}/{processes}, ~{mean_s * (processes - len(done)) / 60:.0f} min left]"


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--quick", action="store_true", help="smoke run: tiny models, short windows")
    p.add_argument("--models", nargs="*", help=f"generated models (default {FULL['models']})")
    p.add_argument(
        "--model",
        action="append",
        type=Path,
        default=[],
        metavar="PATH",
        help="a real ONNX model, downloaded beforehand (repeatable)",
    )
    p.add_argument("--callers", nargs="+", type=int)
    p.add_argument("--configs", nargs="+", help=f"sharedml configs (default {SHAREDML_CONFIGS})")
    p.add_argument("--ov-configs", nargs="+", help=f"OpenVINO configs (default {OV_CONFIGS})")
    p.add_argument("--rounds", type=int)
    p.add_argument("--warmup-s", type=float)
    p.add_argument("--duration-s", type=float)
    p.add_argument("--size", choices=("full", "tiny"))
    p.add_argument("--seq", type=int, default=32, help="sequence length of transformers")
    p.add_argument("--out-dir", type=Path, default=HERE / "out")
    p.add_argument("--json", type=Path, help="write results here (and the tables beside it)")
    p.add_argument("--render", type=Path, metavar="JSON", help="re-make the .md, measure nothing")
    p.add_argument("--timeout-s", type=float, default=900, help="per process")
    args = p.parse_args(argv)
    preset = QUICK if args.quick else FULL
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for config in args.configs:
        if config.startswith("ov:"):
            raise SystemExit(f"{config!r}: OpenVINO configurations go in --ov-configs")
        family(config)  # refuses unknown names before anything runs
    for config in args.ov_configs:
        parse_ov_config(config)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--child"]:
        mode, spec = argv[1], json.loads(argv[2])
        print("RESULT " + json.dumps({"worker": worker, "warm": warm}[mode](spec)), flush=True)
        return 0
    args = _parse(argv)
    if args.render is not None:
        args.render.with_suffix(".md").write_text(
            render_markdown(json.loads(args.render.read_text()))
        )
        return 0
    if not _have_openvino():
        print("openvino is not installed: pip install -e '.[peer]' (a benchmark-only extra)")
        return 2
    for path in args.model:
        if not path.is_file():
            print(f"{path}: no such model file (download it beforehand; nothing is fetched)")
            return 2
    started = time.perf_counter()
    metas = [serving._model(m, args) for m in args.models]
    metas += [serving._external_model(path.resolve()) for path in args.model]
    doc: dict[str, Any] = {
        "schema": SCHEMA,
        "command": shlex.join(["python", "benchmarks/peer_openvino.py", *argv]),
        "machine": _machine(),
        "settings": {
            k: getattr(args, k)
            for k in ("callers", "rounds", "warmup_s", "duration_s", "size", "seq")
        }
        | {"configs": args.configs, "ov_configs": args.ov_configs},
        "models": [],
        "results": [],
    }
    processes = (
        args.rounds
        * len(metas)
        * sum(len(configs_for(c, args.configs, args.ov_configs)) for c in args.callers)
    )
    print(f"{processes} measured processes ahead", flush=True)
    cache_dir = str(args.out_dir / "peer-cache")
    with tempfile.TemporaryDirectory() as tmp:
        bases: list[dict[str, Any]] = []
        for meta in metas:
            base = {
                **meta,
                "providers": CPU,
                "seq": args.seq,
                "cache_dir": cache_dir,
                "references": str(Path(tmp) / f"{len(bases)}-refs.npz"),
            }
            ref = serving._child("references", base, args.timeout_s)
            if "error" in ref:
                print(f"{meta['name']}: references failed: {ref['error']}", flush=True)
                continue
            pools = [c for c in args.configs if family(c).startswith("sharedml")]
            warmed = serving._child(
                "warm", {**base, "configs": pools}, args.timeout_s, Path(__file__)
            )
            if "error" in warmed:
                print(f"{meta['name']}: sharedml's cache: {warmed['error']}", flush=True)
            doc["models"].append(
                {"name": meta["name"], "weights_bytes": meta["weights_bytes"], "warm": warmed}
            )
            bases.append(base)
        for k in range(args.rounds):
            for base in bases:
                for callers in args.callers:
                    names = configs_for(callers, args.configs, args.ov_configs)
                    for config in _rotated(names, k):
                        spec = {
                            **base,
                            "config": config,
                            "callers": callers,
                            "warmup_s": args.warmup_s,
                            "duration_s": args.duration_s,
                        }
                        t0 = time.perf_counter()
                        result = serving._child("worker", spec, args.timeout_s, SCRIPT)
                        result |= {
                            "model": base["name"],
                            "round": k,
                            "callers": callers,
                            "config": config,
                            "family": family(config),
                            "process_s": time.perf_counter() - t0,
                        }
                        doc["results"].append(result)
                        print(_line(base["name"], result) + _eta(doc, processes), flush=True)
            doc["wall_s"] = time.perf_counter() - started
            _write(doc, args.json)
    doc["machine"]["loadavg_end"] = os.getloadavg()
    doc["wall_s"] = time.perf_counter() - started
    _write(doc, args.json)
    print(render_markdown(doc), flush=True)
    print(f"took {doc['wall_s'] / 60:.1f} min", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

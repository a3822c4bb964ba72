"""``sharedml inspect A B ...``: what a family of models holds, and what its sessions cost.

The static part hashes every tensor prepare would move, in every member (content identity:
:class:`sharedml.TensorDigest`), and reports the distinct against the total bytes. The measured
part runs, each in a fresh process, N plain ``InferenceSession`` per member and then one
``SessionPool`` of N per member, all run once, and reads the PSS growth of each process: the
pools' figure is what the family costs with sharedml's defaults (no family named: identical
weights share through the cache).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from sharedml._errors import MeasurementError
from sharedml._host import HashingWriter
from sharedml.model._graph import read_model
from sharedml.prepared._format import TensorDigest, digest_of
from sharedml.prepared._plan import DEFAULT_SIZE_THRESHOLD_BYTES, plan_weights
from sharedml.prepared._source import SourceReader

__all__ = ["FamilyReport", "family_weights", "inspect_family", "measure_family"]


@dataclasses.dataclass(frozen=True)
class FamilyReport:
    """What ``sharedml inspect A B ...`` reports (``--json``: :meth:`to_dict`).

    Attributes:
        models: The members, as given.
        tensors_total: Tensors prepare would move, counted per member.
        tensors_distinct: Distinct ones by content (dtype, shape, SHA-256 of the bytes).
        total_bytes: Their data, counted per member: what separate copies hold.
        distinct_bytes: Data of the distinct tensors: what one copy of the family holds.
        sessions: Sessions per member in the measurements (0: not measured).
        plain_bytes: PSS growth of one process holding N plain sessions of every member.
        pooled_bytes: PSS growth of one process holding a pool of N over every member.
        mechanisms: The route each member's pool took.
    """

    models: tuple[str, ...]
    tensors_total: int
    tensors_distinct: int
    total_bytes: int
    distinct_bytes: int
    sessions: int = 0
    plain_bytes: int | None = None
    pooled_bytes: int | None = None
    mechanisms: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready form."""
        return {"kind": "family", **dataclasses.asdict(self)}


def family_weights(
    models: Sequence[str | os.PathLike[str]],
    *,
    size_threshold_bytes: int = DEFAULT_SIZE_THRESHOLD_BYTES,
) -> tuple[int, int, int, int]:
    """(tensors total, tensors distinct, bytes total, bytes distinct) over ``models``.

    Counts the tensors prepare would move (its threshold), by content, whatever their names.
    """
    seen: set[TensorDigest] = set()
    tensors = distinct_tensors = total = distinct = 0
    for path in map(Path, models):
        model, model_bytes = read_model(path)
        with SourceReader(model_bytes) as reader:
            del model_bytes
            plan = plan_weights(model, path, size_threshold_bytes)
            for index, item in enumerate(plan.moving):
                content = HashingWriter()  # to nowhere: the tensor's own digest
                content.write_all(reader.chunks(index, item))
                key = digest_of(item.tensor, content)
                tensors += 1
                total += item.nbytes
                if key not in seen:
                    seen.add(key)
                    distinct_tensors += 1
                    distinct += item.nbytes
    return tensors, distinct_tensors, total, distinct


# The measuring child: N sessions per member, all run once, then the PSS growth.
_CHILD = r"""
import contextlib, gc, json, sys
import numpy as np, onnxruntime as ort, psutil
import sharedml
from sharedml._host import release_freed_heap
from sharedml.model._inputs import described, generate, input_specs, load_feeds
from sharedml.model._graph import load_graph
mode, n, sizes, models = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4:]
def pss():
    gc.collect(); release_freed_heap()
    info = psutil.Process().memory_full_info()
    return getattr(info, "pss", info.uss)
feeds = []
for m in models:
    graph = load_graph(m)
    # --dim and --shape name what any member has: each member takes the ones it has.
    names = {i.name: [d.dim_param for d in i.type.tensor_type.shape.dim] for i in graph.graph.input}
    dims = {k: v for k, v in sizes["dims"].items() if any(k in d for d in names.values())}
    shapes = {k: v for k, v in sizes["shapes"].items() if k in names}
    values = {k: v for k, v in (load_feeds(sizes["inputs"]) if sizes["inputs"] else {}).items()
              if k in names}
    # Symbolic dims nobody gave stay 1 here (the family's members must agree on one size);
    # single-model inspect chooses plausible sizes and reports them.
    specs = input_specs(graph, dims, shapes=shapes, given=described(values), model_name=m,
                        guess="ones")
    feeds.append({s.name: values[s.name] if s.name in values else
                  generate({"name": s.name, "dtype": s.dtype, "shape": s.shape}) for s in specs})
sharedml.SessionPool  # the modules load lazily: before the baseline
base = pss()
held, mechanisms = [], []
for m, feed in zip(models, feeds):
    if mode == "plain":
        sessions = [ort.InferenceSession(m, providers=["CPUExecutionProvider"]) for _ in range(n)]
        for s in sessions:
            s.run(None, feed)
        held.append(sessions)
    else:
        pool = sharedml.SessionPool(m, sessions=n, prepacking="off" if mode == "raw" else "auto")
        pool.wait_ready()
        with contextlib.ExitStack() as stack:  # every session checked out, each run once
            for s in [stack.enter_context(pool.session()) for _ in range(n)]:
                s.run(None, feed)
        held.append(pool)
        mechanisms.append(str(pool.mechanism))
grown = pss() - base
print(json.dumps({"pss": grown, "mechanisms": mechanisms}))
for h in held:
    if not isinstance(h, list):
        h.close()
"""


def measure_family(
    mode: str,
    sessions: int,
    models: Sequence[str],
    timeout_s: float | None = None,
    *,
    dims: Mapping[str, int] | None = None,
    shapes: Mapping[str, Sequence[int]] | None = None,
    inputs: str | os.PathLike[str] | None = None,
) -> Any:
    """One measuring process; returns ``{"pss": bytes, "mechanisms": [...]}``.

    ``mode``: "plain" (ORT sessions), "pooled" (pools, defaults) or "raw" (prepacking off).
    ``dims``/``shapes``/``inputs``: as ``sharedml inspect --dim/--shape/--inputs``, each
    applied to the members that have that dim or input (other symbolic dims are 1).
    """
    sizes = json.dumps(
        {
            "dims": dict(dims or {}),
            "shapes": {k: list(v) for k, v in (shapes or {}).items()},
            "inputs": str(inputs) if inputs is not None else None,
        }
    )
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, mode, str(sessions), sizes, *models],
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    if done.returncode != 0:
        given = "" if dims or shapes or inputs else " with every symbolic dim set to 1"
        raise MeasurementError(
            f"Measuring {mode} sessions of the family failed{given} (exit {done.returncode}): "
            f"{done.stderr.strip()[-1500:]} Give the inputs' sizes with --dim NAME=VALUE or "
            "--shape INPUT=AxB, or real values with --inputs FEEDS.npz (as for one model)."
        )
    return json.loads(done.stdout.strip().splitlines()[-1])


def inspect_family(
    models: Sequence[str | os.PathLike[str]],
    *,
    sessions: int = 4,
    measure: bool = True,
    timeout_s: float | None = None,
    dims: Mapping[str, int] | None = None,
    shapes: Mapping[str, Sequence[int]] | None = None,
    inputs: str | os.PathLike[str] | None = None,
) -> FamilyReport:
    """Report a family's distinct vs total weights and, measured, plain vs pooled memory.

    Args:
        models: Two or more ONNX models.
        sessions: Sessions per member in each measurement.
        measure: False: the static part only.
        timeout_s: Limit for each measuring process.
        dims: Sizes of symbolic dims (``--dim``), for every member that has the dim.
        shapes: Whole input shapes (``--shape``), for every member that has the input.
        inputs: An ``.npz`` of input values by name (``--inputs``), for every member that has
            the input.

    Raises:
        ModelError: a member cannot be read.
        MeasurementError: a measuring process failed.
    """
    names = tuple(str(m) for m in models)
    tensors, distinct_tensors, total, distinct = family_weights(models)
    report = FamilyReport(names, tensors, distinct_tensors, total, distinct)
    if not measure:
        return report
    run = functools.partial(
        measure_family, models=names, timeout_s=timeout_s, dims=dims, shapes=shapes, inputs=inputs
    )
    run("pooled", 1)  # fills the cache: its one-off build is not counted
    plain = run("plain", sessions)
    pooled = run("pooled", sessions)
    return dataclasses.replace(
        report,
        sessions=sessions,
        plain_bytes=int(plain["pss"]),
        pooled_bytes=int(pooled["pss"]),
        mechanisms=tuple(pooled["mechanisms"]),
    )

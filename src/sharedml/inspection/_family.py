"""``sharedml inspect A B ...``: what a family of models holds, and what its sessions cost.

The static part hashes every tensor prepare would move, in every member (content identity:
:class:`sharedml.TensorDigest`), and reports the distinct against the total bytes. The measured
part runs, each in a fresh process, N plain ``InferenceSession`` per member and then one
``SessionPool`` of N per member, all run twice (ORT allocates a shape's planned activation
memory on the second run), and reads the PSS growth of each process: the
pools' figure is what the family costs with sharedml's defaults (no family named: identical
weights share through the cache).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from sharedml._errors import MeasurementError
from sharedml._host._hashing import HashingWriter
from sharedml.inspection._child import SPEC_VERSION
from sharedml.model._graph import read_model
from sharedml.prepared._format import TensorDigest, digest_of
from sharedml.prepared._plan import DEFAULT_SIZE_THRESHOLD_BYTES, plan_weights
from sharedml.prepared._source import SourceReader
from sharedml.runtime._child import ChildFailed, entry_code, run_child

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
    """One measuring process; returns ``{"pss": bytes, "metric": ..., "mechanisms": [...]}``.

    ``mode``: "plain" (ORT sessions), "pooled" (pools, defaults) or "raw" (prepacking off).
    ``dims``/``shapes``/``inputs``: as ``sharedml inspect --dim/--shape/--inputs``, each
    applied to the members that have that dim or input (other symbolic dims are 1). The child
    is the measuring child's family mode (:mod:`sharedml.inspection._child`).

    Raises:
        MeasurementError: the child failed or ran past ``timeout_s``; the message names the
            mode, the child's last stderr line and how to give the inputs' sizes.
    """
    spec = {
        "version": SPEC_VERSION,
        "mode": "family",
        "family_mode": mode,
        "sessions": int(sessions),
        "models": [str(m) for m in models],
        "dims": dict(dims or {}),
        "shapes": {k: list(v) for k, v in (shapes or {}).items()},
        "feeds_file": str(Path(inputs).resolve()) if inputs is not None else None,
    }
    given = "" if dims or shapes or inputs else " with every symbolic dim set to 1"
    try:
        return run_child(
            [json.dumps(spec)],
            code=entry_code("sharedml.inspection._child:measuring_child"),
            what=f"Measuring {mode} sessions of the family{given}",
            timeout_s=timeout_s,
        )
    except ChildFailed as exc:
        if exc.timed_out:
            raise MeasurementError(str(exc)) from None
        raise MeasurementError(
            f"{exc} Give the inputs' sizes with --dim NAME=VALUE or --shape INPUT=AxB, or real "
            "values with --inputs FEEDS.npz (as for one model)."
        ) from None


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

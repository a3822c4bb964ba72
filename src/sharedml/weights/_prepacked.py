"""The CPU route that gives N sessions one copy of the weights AND ORT's prepacked kernel speed.

The problem: at session creation ORT's CPU kernels "prepack" constant weights (MatMul, Gemm,
the quantized MatMuls, Conv, RNNs...) into a kernel layout in that session's heap, and its
optimizers derive new weights (NCHWc filters, folded constants), also per session. Shared raw
weights or not, N sessions then hold N packed copies; with prepacking off the raw weights are
shared but batched kernels run slower (``docs/cpu-prepacking.md`` has the figures).

The route: ORT can save the optimized model with its prepacked blobs next to the raw initializers
in the data file (``session.save_external_prepacked_constant_initializers=1``). A session that
loads that model *by path* maps the blobs and the derived weights from the file, so all sessions
of all processes share the same page-cache pages: one copy, at prepacked speed. The saved model
is a ``prepacked`` entry of the cache (:mod:`sharedml.cache`), keyed by ORT build and CPU.

Decisions, each measured (figures and commands: ``docs/cpu-prepacking.md``):

* Sessions load the saved model by path, never through the in-memory-file route: with it ORT
  ignores the blobs and every session packs again.
* ORT still packs every weight at load to validate the mapped blob, then frees that work; the
  pool trims the heap after each creation (:func:`sharedml._host._platform.release_freed_heap`), or
  glibc keeps the freed pages.
* Small initializers stay inline in the saved model: ORT maps each external initializer per
  session, and Linux caps maps per process (``vm.max_map_count``).
* The route planner takes this route only where ORT packs or derives a weight, and not where
  the maps of all sessions would crowd the per-process map limit: a policy over this module's
  figures (:class:`PrepackStats`), which lives with the routes
  (:func:`sharedml.route._cpu.choose_cpu_route`).
* The C API's prepacked-weights container is not reachable from Python (``InferenceSession``
  cannot adopt a session made through ctypes), so this file route is the one Python has.

Thread safety: :func:`build_prepacked_model` may run concurrently, also in several processes,
for one key: builders race to the cache's atomic publish and the losers use the winner's entry.
:meth:`PrepackedModel.apply` writes only to the ``SessionOptions`` it is given.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import mmap
import os
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sharedml._errors import (
    CacheError,
    ExternalDataError,
    ModelNotFoundError,
    SessionCreationError,
    UnsupportedModelError,
)
from sharedml._host import _hashing, _platform
from sharedml.cache._entries import CacheEntry, ensure_entry, iter_entries
from sharedml.cache._root import Cache, CacheDir
from sharedml.model._graph import (
    ExternalData,
    external_locations,
    iter_graphs,
    iter_tensors,
    load_graph,
)
from sharedml.model._proto import ModelProto, parse_model
from sharedml.runtime._capabilities import capability
from sharedml.runtime._errors import is_model_refused, refused_model_error
from sharedml.runtime._options import config_entry, graph_settings

if TYPE_CHECKING:
    import onnxruntime as ort

__all__ = [
    "PrepackStats",
    "PrepackedModel",
    "build_prepacked_model",
    "inspect_prepacked_model",
]

_KIND = "prepacked"  # the cache's entry kind
_MODEL_NAME = "model.onnx"
_DATA_NAME = "model.data"
_FORMAT = 3  # bump when an entry's layout, or what goes into its key, changes
_PAGE_BYTES = mmap.PAGESIZE  # bytes; a blob at a page-aligned offset is mapped without slack

# Initializers below this size stay inside the saved .onnx instead of its data file: a small
# tensor costs each session a private copy of a few KiB, where an external one costs a map.
_DEFAULT_MIN_EXTERNAL_BYTES = 64 * 1024  # bytes


@dataclasses.dataclass(frozen=True)
class PrepackStats:
    """What a saved prepacked model holds, read from its protobuf (no session is created).

    Attributes:
        external_initializers: initializers whose data lives in the data file.
        raw_bytes: bytes of those initializers' raw data.
        prepacked_blobs: prepacked buffers saved next to them.
        prepacked_bytes: bytes of those buffers. 0 means ORT packs nothing of this model on this
            CPU.
        derived_bytes: bytes of external initializers that the source model does not have, made
            by ORT's optimizers (NCHWc-reordered filters, folded or fused constants). On the
            shared-raw route every session makes its own copy of these. 0 when unknown.
        unaligned_blobs: blobs whose file offset is not page-aligned (mapped with some slack).
        maps_per_session: memory maps one session makes of the data file: one per blob, plus
            one per external initializer without a blob.
        inline_packed_blobs: Weights ORT packs that the saved model keeps inline (under
            ``min_external_bytes``, where ORT saves no packed form: each session packs its own
            copy, as plain ORT does), counted by saving the model once more with every
            initializer external. None where not counted (the saved model has blobs) or where
            it could not be told.
        inline_packed_bytes: Their packed bytes (None as above).
        session_pack_bytes: What one session over the raw weights costs more with prepacking
            on than off (anonymous memory, measured at the build where ORT packs weights no
            saved model shares, or may): the inline packs, and the packs of kernels that save
            no packed form at all (int8 ``QLinearConv`` in NHWC). None where not measured.
    """

    external_initializers: int
    raw_bytes: int
    prepacked_blobs: int
    prepacked_bytes: int
    derived_bytes: int
    unaligned_blobs: int
    maps_per_session: int
    inline_packed_blobs: int | None = None
    inline_packed_bytes: int | None = None
    session_pack_bytes: int | None = None


@dataclasses.dataclass(frozen=True)
class PrepackedModel:
    """An optimized model whose data file carries ORT's prepacked weights, to load N times.

    Attributes:
        model_path: The optimized model. Pass ``str(model_path)`` to ``InferenceSession``: ORT
            must open the data file itself.
        data_path: Its data file (raw and derived initializers, prepacked blobs), next to it.
        key: The cache key of this entry (hex).
        stats: What the data file holds.
        hold: Keeps the cache entry from removal while sessions may map its data file.
    """

    model_path: Path
    data_path: Path
    key: str
    stats: PrepackStats
    hold: Any = dataclasses.field(default=None, compare=False, repr=False)

    def apply(self, so: ort.SessionOptions) -> None:
        """Set what a session needs to load this model with shared prepacked weights.

        Nothing has to be kept alive for the session: ORT maps ``data_path`` itself.

        * ``graph_optimization_level = ORT_DISABLE_ALL``: the graph is already optimized at the
          level the key records; optimizing again is redundant work per session.
        * ``session.disable_prepacking = 0``, where the options said otherwise: with prepacking
          off the kernels ignore the blobs and run unpacked.
        * Deliberately not set: ``session.prepack.enable_parallel`` (onnxruntime 1.32), which
          spreads the validation pack every session makes at load over its intra-op threads.
          Each process kept about 14-16 MiB more for it (4 workers of 2 sessions over a 96 MiB
          MLP, ``tests/test_multiprocess.py``: 71 -> 85 MiB PSS a worker), the freed packs
          staying in the threads' heaps, for a start-up gain not measured on a quiet machine.
          A caller's template may set it.
        * Deliberately not set, and not to be set by the caller either:
          ``add_external_initializers_from_files_in_memory`` for this file (ORT then ignores the
          blobs and each session packs a private copy), nor a weight store's registration for
          the *source* model's weights file (this model does not read it).

        Args:
            so: The options of ONE session, modified in place.
        """
        import onnxruntime as ort

        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        if config_entry(so, "session.disable_prepacking") not in (None, "0"):
            so.add_session_config_entry("session.disable_prepacking", "0")

    @classmethod
    def _of(cls, entry: CacheEntry) -> PrepackedModel:
        try:
            stats = PrepackStats(**entry.meta["stats"])
        except (KeyError, TypeError) as exc:
            raise CacheError(
                f"The cache entry '{entry.path}' has no readable prepack figures ({exc}). Remove "
                "it; sharedml builds it again."
            ) from None
        return cls(entry.file(_MODEL_NAME), entry.file(_DATA_NAME), entry.key, stats, entry.hold)


def build_prepacked_model(
    prepared_model: str | os.PathLike[str],
    weights_file: str | os.PathLike[str] | Mapping[str, str | os.PathLike[str]] | None,
    cache_dir: CacheDir = None,
    *,
    sess_options: ort.SessionOptions | None = None,
    weights_digest: str | None = None,
    min_external_bytes: int = _DEFAULT_MIN_EXTERNAL_BYTES,
    verify: bool = True,
    share: bool = True,
    graph: ModelProto | None = None,
) -> PrepackedModel:
    """Return the cached prepacked form of ``prepared_model``, building it first if needed.

    Identical weights are shared across entries (``share``): an initializer whose raw bytes and
    prepacked blobs equal those of one in another prepacked entry of the same ORT build and
    CPU (whatever its name or model) is pointed at that entry's data file, hard-linked into
    this entry's folder, so every model's sessions map the same pages (see
    :func:`_share_identical` and ``docs/families.md``).

    A build creates one CPU session over ``prepared_model`` that saves its optimized graph with
    ``session.save_external_prepacked_constant_initializers=1`` into the cache's temporary
    folder, reloads the result once as :meth:`PrepackedModel.apply` would (ORT validates every
    blob against a fresh pack, so a bad entry fails here and not in the pool), runs it on inputs
    generated from the model's signature and compares its outputs with the saving session's
    (plain ORT's), and publishes it: a saved form that computes other values is never used.
    A build costs about one fully optimized session creation, one reload and about twice the
    weights written to disk.

    The key covers what changes the bytes ORT writes or whether an ORT would accept them: this
    entry format, the onnxruntime version and build, the CPU fingerprint, the prepared model's
    bytes, the weights (``weights_digest``, or a SHA-256 of ``weights_file``) and their size,
    the optimization level, the config entries that change the graph
    (:data:`sharedml.runtime._options.CONFIG_KEYS`) and ``min_external_bytes``.

    Args:
        prepared_model: A model whose large initializers are external data in ``weights_file``
            (small ones may be inline; it may also have no external data at all).
        weights_file: The one external data file ``prepared_model`` refers to, or None if it has
            none. ORT reads it zero-copy through a read-only map registered under the name the
            model uses, so it need not sit where the model's ``location`` points. A model over
            several weights files (a cache entry that shares tensors with others) passes them
            all, as ``{location: path}``.
        cache_dir: The cache: a :class:`sharedml.cache.Cache` (as the route planner passes it),
            a path, or None for :func:`sharedml.cache_dir`; resolved once.
        sess_options: The options the pool gives its sessions. Only the optimization level and
            the config entries that change the optimized graph are used; free-dimension
            overrides and custom ops are not carried. None means ORT's defaults.
        weights_digest: A content digest of ``weights_file`` that the caller already has (a
            prepared model's manifest records its SHA-256). Without it the file is hashed.
        min_external_bytes: Initializers smaller than this stay inline in the saved model.
        verify: Check a published entry's files against the SHA-256 recorded when it was built
            (a stamp spares re-reading unchanged files).
        share: Point identical initializers (raw bytes and blobs) at other entries' data files
            through hard links, so that models holding the same weights share their pages.
        graph: ``prepared_model``'s graph where the caller parsed it already (the route
            planner: once per pool), so that it is not parsed again; never modified. The key
            still hashes the file's bytes.

    Returns:
        The entry; its ``stats`` feed :func:`sharedml.route._cpu.choose_cpu_route`.

    Raises:
        ValueError: ``sess_options`` sets ``session.disable_prepacking=1``, or the model has
            external data and ``weights_file`` is None.
        ModelNotFoundError: ``prepared_model`` or ``weights_file`` does not exist.
        ExternalDataError: ``prepared_model`` refers to more than one external data file.
        SessionCreationError: onnxruntime could not build or reload the model; no entry is kept.
        CacheError: the cache folder fails sharedml's permission policy.

    Thread safety: safe to call concurrently, also from several processes sharing ``cache_dir``.
    Leaves the process's heap trimmed after a build.
    """
    plan = _plan_build(
        prepared_model,
        weights_file,
        cache_dir,
        sess_options=sess_options,
        weights_digest=weights_digest,
        min_external_bytes=min_external_bytes,
        share=share,
        graph=graph,
    )
    entry = ensure_entry(_KIND, plan.key, plan.build, cache=plan.cache, verify=verify)
    return PrepackedModel._of(entry)


# --------------------------------------------------------------------------------------------
# The build: first what it is (the plan: inputs checked, key computed; nothing written), then
# one place that writes the entry (:meth:`_BuildPlan.build`), step by step.


@dataclasses.dataclass(frozen=True)
class _BuildPlan:
    """One prepacked entry to build: its inputs, checked, and its key (see :func:`_plan_build`).

    Attributes:
        model: The prepared model.
        source: Its graph (external data not loaded).
        files: The weights files it reads, by the location its tensors name.
        key_material: What the key covers (:func:`_key_material`).
        key: The cache key.
        min_external_bytes: Initializers smaller than this stay inline in the saved model.
        share: Point identical initializers at other entries' data files.
        cache: The cache the entry goes to.
    """

    model: Path
    source: ModelProto
    files: Mapping[str, Path]
    key_material: dict[str, Any]
    key: str
    min_external_bytes: int
    share: bool
    cache: Cache

    def build(self, tmp: Path) -> dict[str, Any]:
        """Write the entry into ``tmp``, check that ORT reloads it to plain ORT's values.

        Returns:
            The entry's metadata.
        """
        options = _BuildOptions.over(self)
        so = options.saving(tmp, self.min_external_bytes)
        try:
            reference = _save_optimized(self.model, so, self.source)
            stats = _make_self_contained(self, tmp)
            if stats.prepacked_blobs == 0:
                stats = _count_inline_packs(self.model, options, tmp, stats)
            own_index = _blob_index(tmp / _MODEL_NAME)
            sharing = _share_then_check(self, tmp, stats, own_index, reference)
        except UnsupportedModelError:
            raise
        except Exception as exc:
            raise SessionCreationError(
                f"onnxruntime could not save or reload the prepacked form of '{self.model}': "
                f"{exc}. Use the shared-raw route for this model."
            ) from exc
        finally:
            options.release()  # the maps of the weights: unmapped once unreferenced
            _platform.release_freed_heap()  # the two sessions freed about twice the weights
        return {
            "source": str(self.model),
            "key_material": self.key_material,
            "stats": dataclasses.asdict(stats),
            # What a later entry may share: every external initializer's content and place.
            "blobs": sharing.index if sharing is not None else own_index,
            "shared": sharing.summary() if sharing is not None else None,
        }


def _plan_build(
    prepared_model: str | os.PathLike[str],
    weights_file: str | os.PathLike[str] | Mapping[str, str | os.PathLike[str]] | None,
    cache_dir: CacheDir,
    *,
    sess_options: ort.SessionOptions | None,
    weights_digest: str | None,
    min_external_bytes: int,
    share: bool,
    graph: ModelProto | None = None,
) -> _BuildPlan:
    """Check :func:`build_prepacked_model`'s arguments and compute the entry's key.

    Reads the model (parses it unless ``graph`` is its graph) and (without a digest) hashes
    its weights; writes nothing.
    """
    cache = Cache.at(cache_dir)
    prepared_model = Path(prepared_model)
    try:
        model_bytes = prepared_model.read_bytes()
    except FileNotFoundError:
        raise ModelNotFoundError(
            f"Model '{prepared_model}' does not exist. Pass the path of a prepared model."
        ) from None
    source = graph if graph is not None else parse_model(model_bytes)
    files = _weights_files(prepared_model, source, weights_file)
    if config_entry(sess_options, "session.disable_prepacking") == "1":
        raise ValueError(
            "sess_options sets session.disable_prepacking=1, but the prepacked route exists to "
            "keep prepacking on. Use the shared-raw route, or drop that entry."
        )
    weights_size = 0
    for weights_path in files.values():
        try:
            weights_size += weights_path.stat().st_size
        except FileNotFoundError:
            raise ModelNotFoundError(
                f"Weights file '{weights_path}' of model '{prepared_model}' does not exist."
            ) from None
    if files and weights_digest is None:
        weights_digest = "sha256:" + ",".join(
            _hashing.sha256_file(files[name]) for name in sorted(files)
        )
    key_material = _key_material(
        model_bytes, weights_digest, weights_size, sess_options, min_external_bytes
    )
    key = hashlib.sha256(json.dumps(key_material, sort_keys=True).encode()).hexdigest()[:32]
    return _BuildPlan(
        prepared_model, source, files, key_material, key, min_external_bytes, share, cache
    )


def _weights_files(
    prepared_model: Path,
    source: ModelProto,
    weights_file: str | os.PathLike[str] | Mapping[str, str | os.PathLike[str]] | None,
) -> dict[str, Path]:
    """The weights files ``source`` reads, by location, from ``weights_file`` as given."""
    if isinstance(weights_file, Mapping):
        files = {location: Path(path) for location, path in weights_file.items()}
        missing = sorted(external_locations(source.graph) - set(files))
        if missing:
            raise ExternalDataError(
                f"Model '{prepared_model}' keeps weights in {', '.join(missing)}, which "
                "weights_file does not give."
            )
        return files
    location = _single_external_location(source, prepared_model)
    if location is not None and weights_file is None:
        raise ValueError(
            f"Model '{prepared_model}' keeps weights in the external file '{location}', but "
            "weights_file is None. Pass the path of that file."
        )
    if location is not None and weights_file is not None:
        return {location: Path(weights_file)}
    return {}


@dataclasses.dataclass
class _BuildOptions:
    """The session options of one build, every session over the same weights.

    Where ORT takes weights files in memory, they are mapped once here and lent to each
    session; elsewhere ORT reads them itself, from where the model says they are.
    """

    level: int
    carried: Mapping[str, str]
    names: list[str]
    maps: list[Any]

    @classmethod
    def over(cls, plan: _BuildPlan) -> _BuildOptions:
        """The options of ``plan``'s build, its weights files mapped where ORT can borrow them."""
        maps: list[Any] = []
        if plan.files and capability("files-in-memory").available:
            import numpy as np

            maps = [np.memmap(plan.files[n], dtype=np.uint8, mode="r") for n in sorted(plan.files)]
        elif plan.files:
            _check_read_by_path(plan.model, plan.files)  # ORT reads the weights file itself
        material = plan.key_material
        return cls(material["optimization_level"], material["config"], sorted(plan.files), maps)

    def saving(self, folder: Path, min_bytes: int) -> ort.SessionOptions:
        """Options of a session that saves the optimized, prepacked model into ``folder``."""
        so = self._common()
        so.optimized_model_filepath = str(folder / _MODEL_NAME)
        so.add_session_config_entry(
            "session.optimized_model_external_initializers_file_name", _DATA_NAME
        )
        so.add_session_config_entry(
            "session.optimized_model_external_initializers_min_size_in_bytes", str(min_bytes)
        )
        so.add_session_config_entry("session.save_external_prepacked_constant_initializers", "1")
        self._lend_weights(so)
        return so

    def plain(self, prepack: bool) -> ort.SessionOptions:
        """Options of a session over the prepared model as a raw-weights pool makes it."""
        so = self._common()
        so.add_session_config_entry("session.disable_prepacking", "0" if prepack else "1")
        self._lend_weights(so)
        return so

    def release(self) -> None:
        """Drop the maps of the weights (unmapped once no session refers to them)."""
        self.maps.clear()

    def _common(self) -> ort.SessionOptions:
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel(self.level)
        # At ORT_ENABLE_ALL, ORT warns that the saved model is hardware-specific: expected
        # here (the key names the CPU), so only errors are logged.
        so.log_severity_level = 3
        for k, v in self.carried.items():
            so.add_session_config_entry(k, v)
        return so

    def _lend_weights(self, so: ort.SessionOptions) -> None:
        if self.maps:
            so.add_external_initializers_from_files_in_memory(
                self.names, self.maps, [m.nbytes for m in self.maps]
            )
            so.add_session_config_entry(
                "session.use_external_initializer_file_buffers_directly", "1"
            )


_Reference = tuple[dict[str, Any] | None, list[Any]]  # generated inputs, plain ORT's outputs


def _save_optimized(model: Path, saving: ort.SessionOptions, source: ModelProto) -> _Reference:
    """Have one session over ``model`` save its optimized form; return what it computes.

    What plain ORT computes (prepacking per session) is kept to hold the saved form to it;
    the session goes before the reload, so a build holds one at a time.
    """
    import onnxruntime as ort

    try:
        session = ort.InferenceSession(str(model), saving, providers=["CPUExecutionProvider"])
    except Exception as exc:
        if is_model_refused(exc):  # not prepacking's failure: no session loads this model
            raise refused_model_error(exc, str(model)) from exc
        raise
    return _reference_run(session, source)


def _make_self_contained(plan: _BuildPlan, tmp: Path) -> PrepackStats:
    """Make the model ORT saved in ``tmp`` read only its own files, and count what they hold."""
    if not (tmp / _DATA_NAME).exists():  # nothing was large enough to go external
        (tmp / _DATA_NAME).write_bytes(b"")
    _read_only_own_data(tmp, plan.files)
    _drop_sharedml_metadata(tmp / _MODEL_NAME, plan.key)
    return inspect_prepacked_model(tmp / _MODEL_NAME, source_model=plan.source)


def _count_inline_packs(
    model: Path, options: _BuildOptions, tmp: Path, stats: PrepackStats
) -> PrepackStats:
    """``stats`` of a saved model without blobs, with the packs of the weights it keeps inline.

    No blob: ORT may still pack weights that the saved model keeps inline (under
    ``min_external_bytes``, where ORT saves no packed form): a 1-D U-Net's small ConvTranspose
    filters. Saved once more with every initializer external, ORT shows each packed one by its
    blob.
    """
    blobs, packed = _inline_packs(model, lambda folder: options.saving(folder, 0), tmp)
    cost = None
    if blobs != 0:  # packs each session would make: what do they cost it?
        cost = _packing_cost(model, options.plain)
    return dataclasses.replace(
        stats,
        inline_packed_blobs=blobs,
        inline_packed_bytes=packed,
        session_pack_bytes=cost,
    )


def _share_then_check(
    plan: _BuildPlan,
    tmp: Path,
    stats: PrepackStats,
    own_index: list[dict[str, Any]],
    reference: _Reference,
) -> _Sharing | None:
    """Share what other entries hold (``plan.share``), then reload the entry as a pool would.

    Where ORT refuses the shared form, the entry keeps its own blobs (still correct) and is
    reloaded again; where it refuses that too, the error propagates.
    """
    unshared = (tmp / _MODEL_NAME).read_bytes()
    sharing = (
        _share_identical(tmp, own_index, plan.key_material, plan.cache) if plan.share else None
    )
    try:
        _check_reload(tmp, plan.key, stats, reference)
    except Exception:
        if sharing is None:
            raise
        # ORT refused the shared form: keep the entry's own blobs (still correct).
        (tmp / _MODEL_NAME).write_bytes(unshared)
        for linked in sharing.files:
            (tmp / linked).unlink()
        sharing = None
        _check_reload(tmp, plan.key, stats, reference)
    if sharing is not None and _DATA_NAME not in external_locations(
        load_graph(str(tmp / _MODEL_NAME)).graph
    ):
        # Every initializer now points at other entries' files: ORT's own copy of them
        # is dead weight (byte-identical to the linked file), kept empty as an entry
        # with nothing external keeps it.
        (tmp / _DATA_NAME).unlink()
        (tmp / _DATA_NAME).write_bytes(b"")
    return sharing


def _check_reload(tmp: Path, key: str, stats: PrepackStats, reference: _Reference) -> None:
    """Load the entry in ``tmp`` as :meth:`PrepackedModel.apply` would; compare its outputs."""
    import onnxruntime as ort

    check = ort.SessionOptions()
    PrepackedModel(tmp / _MODEL_NAME, tmp / _DATA_NAME, key, stats).apply(check)
    reloaded = ort.InferenceSession(
        str(tmp / _MODEL_NAME), check, providers=["CPUExecutionProvider"]
    )
    feed, expected = reference
    if feed is not None:
        _check_outputs(reloaded.run(None, feed), expected)


# ORT validates each prepacked blob at load, not what the reloaded graph computes: onnxruntime
# 1.30's reload of 8-bit MatMulNBits weights (accuracy_level 4) gave NaN for a transformer
# whose plain sessions computed finite outputs, so the saved form must also compute what plain
# ORT does. The tolerance allows other kernels' summation orders, not a wrong result.
_OUTPUT_RTOL = 1e-3


def _reference_run(
    sess: ort.InferenceSession, model: ModelProto
) -> tuple[dict[str, Any] | None, list[Any]]:
    """Inputs generated from ``model``'s signature and ``sess``'s outputs for them.

    Symbolic sizes are guessed as ``sharedml inspect`` guesses them: plausible heights, widths
    and lengths, then image axes at their stride (a text recognizer's height of 48), then 1.
    ``(None, [])`` where no input can be generated or the session refuses every guess (a
    model that needs real inputs): the saved form is then checked by ORT's blob validation
    alone.
    """
    import onnxruntime as ort

    from sharedml.model._inputs import SIZE_CHOICES, generate, input_specs

    quiet = ort.RunOptions()
    quiet.log_severity_level = 4  # a refused guess is expected: not an error for ORT to print
    for guess in SIZE_CHOICES:
        try:
            specs = input_specs(model, guess=guess)
            feed = {s.name: generate({"shape": s.shape, "dtype": s.dtype}) for s in specs}
            return feed, list(sess.run(None, feed, quiet))
        except Exception:  # MeasurementError, or ORT's own errors (no common base)
            continue
    return None, []


def _check_outputs(got: list[Any], expected: list[Any]) -> None:
    """Raise ``ValueError`` where the saved form computed other values than plain ORT."""
    import numpy as np

    for index, (out, ref) in enumerate(zip(got, expected, strict=True)):
        if not isinstance(ref, np.ndarray) or ref.dtype.kind not in "fciub":
            continue  # sequences and maps (ai.onnx.ml): not compared
        out = np.asarray(out)
        if out.shape != ref.shape:
            raise ValueError(f"output {index} has shape {out.shape}, plain ORT's {ref.shape}")
        if ref.dtype.kind != "f":
            if not np.array_equal(out, ref):
                raise ValueError(f"output {index} differs from plain ORT's")
            continue
        finite = np.isfinite(ref)
        if not np.array_equal(np.isfinite(out), finite) or not np.array_equal(
            np.isnan(out), np.isnan(ref)
        ):
            raise ValueError(
                f"output {index} holds NaN or infinity where plain ORT's does not "
                f"({int(np.count_nonzero(~np.isfinite(out)))} of {out.size} values)"
            )
        diff = np.abs(out[finite].astype(np.float64) - ref[finite].astype(np.float64))
        scale = float(np.abs(ref[finite]).max(initial=0.0)) or 1.0
        largest = float(diff.max(initial=0.0))
        if largest > _OUTPUT_RTOL * scale:
            raise ValueError(
                f"output {index} differs from plain ORT's by up to {largest:.3g} "
                f"(of a scale of {scale:.3g})"
            )


# --------------------------------------------------------------------------------------------
# Sharing identical packed weights across entries (model families)

_SHARED_PREFIX = "shared-"  # name of a data file hard-linked from another prepacked entry
# The key material two entries must agree on for one's blobs to be offered to the other. ORT
# still validates every blob at load (it packs again and compares), and contents are compared
# by SHA-256 here, so this only avoids pointless offers.
_SHARING_FIELDS = ("format", "ort_version", "ort_build", "cpu", "optimization_level", "config")


def _blob_index(model_path: Path) -> list[dict[str, Any]]:
    """Each external initializer of a saved model: its content digests and external entries.

    ``match`` identifies the content: dtype, shape, SHA-256 of the raw bytes, and for each
    prepacked blob its key, kernel tag and SHA-256. Equal ``match``: the same weight, packed the
    same way.
    """
    import numpy as np

    model = load_graph(str(model_path))
    maps: dict[str, Any] = {}
    index = []
    for ref in iter_tensors(model.graph):
        info = ExternalData.of(ref.tensor)
        if info is None or info.length is None or info.malformed:
            continue
        data: Any = maps.get(info.location)
        if data is None:
            path = model_path.parent / info.location
            data = np.memmap(path, dtype=np.uint8, mode="r") if path.stat().st_size else b""
            maps[info.location] = data
        blobs = []
        for key, value in info.entries:
            if key.startswith("prepacked_"):
                tag, *parts = value.split("|")
                for part in parts:
                    offset, size = (int(v) for v in part.split(";")[:2])
                    blobs.append(
                        [key, tag, hashlib.sha256(data[offset : offset + size]).hexdigest()]
                    )
        raw = hashlib.sha256(data[info.offset : info.offset + info.length]).hexdigest()
        index.append(
            {
                "name": ref.tensor.name,
                "file": info.location,
                "match": [ref.tensor.data_type, list(ref.tensor.dims), info.length, raw, blobs],
                "entries": [list(e) for e in info.entries],
            }
        )
    return index


@dataclasses.dataclass
class _Sharing:
    """What :func:`_share_identical` did to an entry being built."""

    index: list[dict[str, Any]]
    files: dict[str, str]  # linked file name -> the entry key it came from
    tensors: int
    bytes: int

    def summary(self) -> dict[str, Any]:
        return {"files": self.files, "tensors": self.tensors, "bytes": self.bytes}


def _share_identical(
    tmp: Path, own: list[dict[str, Any]], key_material: dict[str, Any], cache: Cache
) -> _Sharing | None:
    """Point this entry's initializers at identical ones of other entries; None if none match.

    Each matching initializer takes the other entry's external entries (raw data and blob
    offsets) with the location of a hard link to that entry's data file, made in ``tmp``. The
    linked bytes are hashed again before they are used: another entry's record is not trusted
    for content. This entry's own data file keeps its copy on disk (ORT wrote it), but no
    session maps those ranges any more; where every initializer is shared, the build empties
    the file. Hard links unavailable (another filesystem, Windows
    without rights): those tensors keep this entry's own copy; ``meta["shared"]`` says what was.
    """
    wanted = {json.dumps(t["match"]): t for t in own}
    offers: dict[str, tuple[CacheEntry, dict[str, Any]]] = {}
    for entry in iter_entries(_KIND, cache=cache):
        if isinstance(entry, CacheError) or entry.path == tmp:
            continue
        theirs = entry.meta.get("key_material") or {}
        if any(theirs.get(f) != key_material.get(f) for f in _SHARING_FIELDS):
            continue
        barred: set[str] | None = None  # read only for an entry that has a match
        for tensor in entry.meta.get("blobs") or ():
            match = json.dumps(tensor.get("match"))
            if match in wanted and match not in offers and tensor.get("file") in entry.files:
                if barred is None:
                    barred = _subgraph_files(entry.path / _MODEL_NAME)
                if tensor.get("file") not in barred:
                    offers[match] = (entry, tensor)
    if not offers:
        return None
    model = load_graph(str(tmp / _MODEL_NAME))
    refs = list(iter_tensors(model.graph))
    by_name = {ref.tensor.name: ref.tensor for ref in refs}
    in_subgraph = {ref.tensor.name for ref in refs if ref.depth}
    linked: dict[tuple[str, str], str] = {}  # (entry key, file) -> name in tmp
    files: dict[str, str] = {}
    shared_tensors = shared_bytes = 0
    index = []
    for item in own:
        offer = offers.get(json.dumps(item["match"]))
        if offer is None or item["name"] in in_subgraph:  # see _subgraph_files
            index.append(item)
            continue
        entry, tensor = offer
        name = linked.get((entry.key, tensor["file"]))
        if name is None:
            name = entry.link_file(tensor["file"], tmp, _SHARED_PREFIX, ".data")
            if name is None:
                index.append(item)  # no hard link here: keep this entry's own copy
                continue
            linked[(entry.key, tensor["file"])] = name
            files[name] = entry.key
        entries = [[k, name if k == "location" else v] for k, v in tensor["entries"]]
        probe = {"file": name, "entries": entries}
        if not _same_bytes(tmp, probe, item):
            index.append(item)
            continue
        proto = by_name[item["name"]]
        del proto.external_data[:]
        for k, v in entries:
            added = proto.external_data.add()
            added.key, added.value = k, v
        index.append({**item, "file": name, "entries": entries})
        shared_tensors += 1
        shared_bytes += int(item["match"][2]) + sum(
            int(p.split(";")[1])
            for k, v in entries
            if k.startswith("prepacked_")
            for p in v.split("|")[1:]
        )
    for name in set(files) - {i["file"] for i in index}:
        (tmp / name).unlink()  # linked, then every tensor of it failed the byte check
        files.pop(name)
    if not shared_tensors:
        return None
    (tmp / _MODEL_NAME).write_bytes(model.SerializeToString())
    return _Sharing(index, files, shared_tensors, shared_bytes)


def _subgraph_files(model_path: Path) -> set[str]:
    """The data files that tensors inside subgraphs (``If``/``Loop``/``Scan`` bodies) refer to.

    ORT has onnx's checker validate the external data of subgraph tensors when it loads a model,
    and onnx (1.22 and later) refuses a data file with more than one hard link ("a potential
    hardlink attack"); main-graph initializers are not checked so. Measured on silero-vad:
    linking such an entry's data file from another entry broke the lending entry's next load.
    So such a file is never lent, and a subgraph tensor never points at a link.
    """
    try:
        model = load_graph(str(model_path))
    except Exception:
        return {_DATA_NAME}  # unreadable: lend nothing of it (its own load will say why)
    files = set()
    for ref in iter_tensors(model.graph):
        info = ExternalData.of(ref.tensor) if ref.depth else None
        if info is not None:
            files.add(info.location)
    return files


def _same_bytes(tmp: Path, theirs: dict[str, Any], ours: dict[str, Any]) -> bool:
    """Whether the ranges ``theirs`` names in ``tmp`` hold exactly ``ours``' digests."""
    import numpy as np

    try:
        data: Any = np.memmap(tmp / theirs["file"], dtype=np.uint8, mode="r")
        entries = dict(theirs["entries"])
        offset, length = int(entries["offset"]), int(entries["length"])
        if hashlib.sha256(data[offset : offset + length]).hexdigest() != ours["match"][3]:
            return False
        digests = []
        for key, value in theirs["entries"]:
            if key.startswith("prepacked_"):
                tag, *parts = value.split("|")
                for part in parts:
                    o, n = (int(v) for v in part.split(";")[:2])
                    digests.append([key, tag, hashlib.sha256(data[o : o + n]).hexdigest()])
        return bool(digests == ours["match"][4])
    except (OSError, ValueError, KeyError):
        return False


def _key_material(
    model_bytes: bytes,
    weights_digest: str | None,
    weights_size: int,
    sess_options: Any,
    min_external_bytes: int,
) -> dict[str, Any]:
    """What a prepacked entry's key covers (see :func:`build_prepacked_model`)."""
    import onnxruntime as ort

    level, carried = graph_settings(sess_options)
    return {
        "format": _FORMAT,
        "ort_version": ort.__version__,
        "ort_build": _ort_build_info(),
        "cpu": _platform.cpu_fingerprint(),
        "model_sha256": hashlib.sha256(model_bytes).hexdigest(),
        "weights_digest": weights_digest,
        "weights_size": weights_size,
        "optimization_level": level,
        "config": carried,
        "min_external_bytes": min_external_bytes,
    }


def _inline_packs(
    prepared_model: Path, options_for: Callable[[Path], Any], tmp: Path
) -> tuple[int | None, int | None]:
    """How many weights ORT packs that a saved model keeps inline, and their packed bytes.

    A session given ``options_for(folder)`` (every initializer external) saves the optimized
    model into a scratch folder inside ``tmp``, which is removed; each weight ORT packed has a
    blob there. Where anything fails, both are None: not known.
    """
    import onnxruntime as ort

    try:
        with tempfile.TemporaryDirectory(dir=tmp) as scratch:
            folder = Path(scratch)
            saving = ort.InferenceSession(
                str(prepared_model), options_for(folder), providers=["CPUExecutionProvider"]
            )
            del saving
            found = inspect_prepacked_model(folder / _MODEL_NAME)
    except Exception:  # ORT's errors have no common base; the route then says it cannot tell
        return None, None
    finally:
        _platform.release_freed_heap()
    return found.prepacked_blobs, found.prepacked_bytes


def _packing_cost(prepared_model: Path, options: Callable[[bool], Any]) -> int | None:
    """Bytes one session holds more with prepacking on than off (``options(prepack)``).

    Each measured twice, as the anonymous memory (``rss - shared``: not the mapped weights)
    a session adds once the freed heap is trimmed; the smaller of each pair is taken. None
    where it cannot be measured.
    """
    import onnxruntime as ort
    import psutil

    me = psutil.Process()

    def anonymous() -> int:
        _platform.release_freed_heap()
        info = me.memory_info()
        return int(info.rss - getattr(info, "shared", 0))

    grown: dict[bool, list[int]] = {True: [], False: []}
    try:
        for prepack in (True, False, True, False):
            before = anonymous()
            session = ort.InferenceSession(
                str(prepared_model), options(prepack), providers=["CPUExecutionProvider"]
            )
            grown[prepack].append(anonymous() - before)
            del session
    except Exception:  # ORT's errors have no common base: not measured
        return None
    finally:
        _platform.release_freed_heap()
    return max(0, min(grown[True]) - min(grown[False]))


def inspect_prepacked_model(
    model_path: str | os.PathLike[str], *, source_model: ModelProto | None = None
) -> PrepackStats:
    """Count what a saved prepacked model's data file holds, from its protobuf alone.

    Args:
        model_path: A model saved with ``session.save_external_prepacked_constant_initializers=1``
            (or any model: one without blobs reports ``prepacked_blobs=0``).
        source_model: The model it was optimized from (external data not loaded), to tell
            initializers the optimizers made (``derived_bytes``); None reports 0 for those.

    Returns:
        The figures :func:`sharedml.route._cpu.choose_cpu_route` decides on.
    """
    model = load_graph(str(model_path))
    source_names = (
        {ref.name for ref in iter_tensors(source_model.graph)} if source_model is not None else None
    )
    external = raw = blobs = packed = derived = unaligned = maps = 0
    for ref in iter_tensors(model.graph):
        info = ExternalData.of(ref.tensor)
        if info is None:
            continue
        external += 1
        own_blobs = 0
        for key, value in info.entries:
            if key.startswith("prepacked_"):
                # "<op type>+<hash>|<offset>;<size>;<checksum>|<offset>;<size>;<checksum>..."
                for part in value.split("|")[1:]:
                    offset, size = (int(v) for v in part.split(";")[:2])
                    own_blobs += 1
                    packed += size
                    unaligned += offset % _PAGE_BYTES != 0
        length = info.length or 0
        raw += length
        blobs += own_blobs
        if source_names is not None and ref.name not in source_names:
            derived += length
        # A session maps each blob; the raw data of a packed weight is read, packed to check the
        # blob, and dropped, so it is not mapped; an unpacked initializer is mapped once.
        maps += own_blobs if own_blobs else 1
    return PrepackStats(external, raw, blobs, packed, derived, unaligned, maps)


def _check_read_by_path(prepared_model: Path, files: Mapping[str, Path]) -> None:
    """Where ORT cannot be handed the weights in memory, they must sit where the model says."""
    for location, path in files.items():
        expected = prepared_model.parent / location
        if not (expected.exists() and os.path.samefile(expected, path)):
            raise ExternalDataError(
                f"Model '{prepared_model}' keeps weights in '{location}', given as '{path}': "
                f"this onnxruntime reads them only from '{expected}' "
                f"({capability('files-in-memory').reason}). Pass the model's own weights file."
            )


def _read_only_own_data(folder: Path, files: Mapping[str, Path]) -> None:
    """Make the saved model in ``folder`` read no file but its own data file.

    ORT does not always save the tensors inside subgraphs (``If``/``Loop``/``Scan`` bodies) as
    it saves the main graph's. Measured with the test models' subgraph weights: 1.20.1 leaves
    them pointing at the source's weights file; 1.24.4 saves every initializer of a subgraph
    twice, first as the source had it (pointing at the source's weights file), then as it saved
    it (in the data file, with its prepacked blobs); 1.32.0 saves each once, in its own file.
    Reloaded from the cache, the first fails ("should be stored in .../model.weights, but it
    doesn't exist"), the second too ("initializer name is not unique"). So here each name keeps
    one copy, the last that ORT saved inline or in the data file, and a tensor that still
    points at a source file gets its bytes copied to the end of the data file, page-aligned.
    The entry then reads nothing outside its folder, on every version.

    Raises:
        ExternalDataError: a tensor points at a file that is neither the data file nor one of
            ``files``.
    """
    model_path = folder / _MODEL_NAME
    model = load_graph(str(model_path))
    deduplicated = _keep_one_copy_of_each(model)
    copied = _copy_foreign_tensors(model, folder / _DATA_NAME, files)
    if deduplicated or copied:
        model_path.write_bytes(model.SerializeToString())


def _is_foreign(tensor: Any) -> bool:
    """Whether ``tensor``'s data lives in a file other than the entry's data file."""
    info = ExternalData.of(tensor)
    return info is not None and info.location != _DATA_NAME


def _keep_one_copy_of_each(model: ModelProto) -> bool:
    """Keep one initializer of each name in every graph; whether any was dropped."""
    changed = False
    for graph, _depth in iter_graphs(model.graph):
        # Of the copies of one name, the last that is inline or in the data file (the last at
        # all where every copy points elsewhere): what ORT itself saved last for it.
        last: dict[str, int] = {}
        for i, tensor in enumerate(graph.initializer):
            if (
                tensor.name not in last
                or not _is_foreign(tensor)
                or _is_foreign(graph.initializer[last[tensor.name]])
            ):
                last[tensor.name] = i
        kept = [t for i, t in enumerate(graph.initializer) if last[t.name] == i]
        if len(kept) != len(graph.initializer):
            del graph.initializer[:]
            graph.initializer.extend(kept)
            changed = True
    return changed


def _copy_foreign_tensors(model: ModelProto, data_path: Path, files: Mapping[str, Path]) -> bool:
    """Copy what tensors read from ``files`` to the end of ``data_path``, and point them there.

    Each range is copied once, page-aligned. Returns whether any tensor was pointed anew.
    """
    changed = False
    copied: dict[tuple[str, int, int], int] = {}  # (file, offset, length) -> offset in data
    with open(data_path, "ab") as data:
        for ref in iter_tensors(model.graph):
            info = ExternalData.of(ref.tensor)
            if info is None or info.location == _DATA_NAME:
                continue
            source = files.get(info.location)
            if source is None or info.length is None or info.malformed:
                raise ExternalDataError(
                    f"onnxruntime saved tensor '{ref.name}' of its optimized model pointing at "
                    f"'{info.location}', a file the build did not give it."
                )
            where = (info.location, info.offset, info.length)
            offset = copied.get(where)
            if offset is None:
                end = data.seek(0, os.SEEK_END)
                offset = end + (-end % _PAGE_BYTES)
                data.write(b"\0" * (offset - end))
                _copy_range(source, info.offset, info.length, data)
                copied[where] = offset
            kept = [(k, v) for k, v in info.entries if k not in ("location", "offset", "length")]
            del ref.tensor.external_data[:]
            for k, v in [
                ("location", _DATA_NAME),
                ("offset", str(offset)),
                ("length", str(info.length)),
                *kept,
            ]:
                entry = ref.tensor.external_data.add()
                entry.key, entry.value = k, v
            changed = True
    return changed


def _copy_range(source: Path, offset: int, length: int, out: Any) -> None:
    """Append ``length`` bytes of ``source`` from ``offset`` to ``out``, a chunk at a time."""
    with open(source, "rb") as fh:
        fh.seek(offset)
        left = length
        while left:
            chunk = fh.read(min(left, _hashing.HASH_CHUNK_BYTES))
            if not chunk:
                raise ExternalDataError(
                    f"Weights file '{source}' ends before byte {offset + length} that its "
                    "model's tensors need: it was truncated. Prepare the model again."
                )
            out.write(chunk)
            left -= len(chunk)


def _drop_sharedml_metadata(model_path: Path, key: str) -> None:
    """Replace the source's ``sharedml.*`` metadata (its weights manifest) with this entry's key.

    ORT copies the prepared model's metadata into the saved one, but the manifest describes a
    weights file this model does not read: ``WeightStore.open`` or the prepare cache would take
    the saved model for a prepared one and look for (and verify) the wrong file.
    """
    model = load_graph(str(model_path))
    kept = [p for p in model.metadata_props if not p.key.startswith("sharedml.")]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    model.metadata_props.add(key="sharedml.prepacked", value=json.dumps({"key": key}))
    # Raw bytes, not onnx.save: only the graph is rewritten, the data file is left as ORT wrote it.
    model_path.write_bytes(model.SerializeToString())


def _single_external_location(model: ModelProto, path: Path) -> str | None:
    locations = external_locations(model.graph)
    if len(locations) > 1:
        raise ExternalDataError(
            f"Model '{path}' refers to {len(locations)} external data files "
            f"({', '.join(sorted(locations))}); the prepacked route takes a model prepared into "
            "one weights file. Run sharedml.prepare on it first."
        )
    return next(iter(locations), None)


def _ort_build_info() -> str:
    import onnxruntime as ort

    get = getattr(ort, "get_build_info", None)
    return str(get()) if get is not None else ""

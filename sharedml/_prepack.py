"""CPU route that gives N sessions one copy of the weights AND ORT's prepacked kernel speed.

Figures: onnxruntime 1.32.0, 2-core x86-64 VM (AVX-512), PSS growth of one process after N
sessions were created and each ran once; "MLP" is 12 x 2048x2048 MatMul+Add+Relu (192 MiB of
weights). Commands and full tables: ``benchmarks/prepack_probe.py``, ``docs/cpu-prepacking.md``.

The problem. At session creation the CPU execution provider "prepacks" constant weights (MatMul,
Gemm/FusedGemm, the quantized MatMuls, MatMulNBits, QLinearConv, RNNs, among others) into a kernel
layout, in that session's heap, and its ORT_ENABLE_ALL optimizers derive new weights (NCHWc
reordered Conv filters, fused or folded constants), also per session. Shared raw weights or not,
8 sessions of the MLP hold 8 packed copies (1733 MiB). With prepacking off the raw
weights are shared (197 MiB) but a batch-8 run takes 2.2x the CPU time (38.8 vs 17.3 ms).

The route. ORT can save the optimized model with its prepacked blobs next to the raw initializers
in the data file (``session.save_external_prepacked_constant_initializers=1``). A session that
loads that model *by path* maps the blobs (and the derived weights) from the file; all sessions
of the process map the same page-cache pages, so there is one copy: 8 MLP sessions, 208 MiB
(after :func:`release_freed_heap`) against 1548 MiB for 8 plain sessions, at prepacked speed.
BERT-base (415 MiB), 4 sessions: 429 MiB against 1706 plain; ResNet-50 (97 MiB), 4 sessions:
135 MiB against 430 plain and 494 for shared raw weights at ORT's default optimization level.

Found on the way (each is the reason for a line below):

* Only the blobs and the initializers no kernel packs stay mapped; the raw copy of a packed weight
  is read, used and dropped. On disk the data file is ~2x the weights; in memory it is 1x.
* ORT still runs every kernel's PrePack at load and compares the result with the blob from the file
  (``ValidatePrePackedWeights``): a blob whose bytes differ fails session creation; a blob whose
  key (op type + hash) differs is silently skipped and the session packs a private copy (right
  output, memory win lost). So loading costs about what packing costs (MLP: 0.1-0.3 s per
  session with the load on this VM, against ~0.01 s for shared raw weights), and entries are
  keyed by ORT build and CPU.
* ORT frees those transient packs, but glibc keeps the freed pages in the heap (its dynamic mmap
  threshold rises after the first large free): up to ~65 MiB per extra MLP session (8 sessions:
  661 MiB). No ORT option removes it (arena off, ``use_device_allocator_for_initializers``,
  ``use_env_allocators``, memory patterns off, one intra-op thread, global thread pool:
  532-706 MiB); ``malloc_trim(0)`` does (:func:`release_freed_heap`). What then stays per extra
  session is ~1.3 MiB, ~1 MiB of it the CPU arena's first chunk (arena off: ~0.3 MiB).
* The zero-copy in-memory route (``add_external_initializers_from_files_in_memory`` +
  ``session.use_external_initializer_file_buffers_directly=1``) must NOT be used for the saved
  model: ORT then ignores the blobs and each session packs a private copy (8 sessions: 1734 MiB).
  So no buffer has to be kept alive on this route: ORT maps the file itself, one map per blob or
  unpacked initializer per session, all over the same page-cache pages.
* The C API's prepacked-weights container (``CreateSessionWithPrepackedWeightsContainer``) is not
  reachable from Python: ``InferenceSession`` cannot adopt an ``OrtSession`` created through
  ctypes, so it would take a ctypes re-implementation of ``Run``. The config key proposed in ORT
  PR #32507, ``session.share_prepacked_weights_for_all_initializers``, is not in 1.32.0.

Whether the route pays depends on the model: :func:`choose_cpu_route` decides from the saved
model's own figures.

Thread-safety: :func:`build_prepacked_model` may run concurrently, also in several processes, for
one cache entry: builders race to an atomic directory rename and the losers discard their copies.
:meth:`PrepackedModel.apply` writes only to the ``SessionOptions`` it is given.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import enum
import functools
import hashlib
import json
import mmap
import os
import platform
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import onnx

from sharedml._errors import ExternalDataError, ModelNotFoundError, SessionCreationError
from sharedml._weights import sha256_of

if TYPE_CHECKING:
    import onnxruntime as ort

__all__ = [
    "CpuRoute",
    "CpuRouteDecision",
    "PrepackStats",
    "PrepackedModel",
    "build_prepacked_model",
    "choose_cpu_route",
    "inspect_prepacked_model",
    "release_freed_heap",
]

_MODEL_NAME = "model.onnx"
_DATA_NAME = "model.data"
_META_NAME = "prepack.json"
_FORMAT = 1  # bump when an entry's layout, or what goes into its key, changes
_PAGE_BYTES = mmap.PAGESIZE  # bytes; a blob at a page-aligned offset is mapped without slack
_READ_ONLY_FILE_MODE = stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH  # 0444: never rewritten in place

# Initializers below this size stay inside the saved .onnx instead of its data file. ORT maps
# each external initializer (or each of its blobs) of each session separately (measured: 12 maps
# per MLP session), and Linux caps maps per process (vm.max_map_count, 65530 by default). Inline,
# a small tensor costs each session a private copy of a few KiB instead, its packed copy too.
_DEFAULT_MIN_EXTERNAL_BYTES = 64 * 1024  # bytes

# Config entries of the caller's SessionOptions that change the optimized graph or the packing:
# the build session copies them and they are part of the cache key. SessionOptions cannot be
# cloned or enumerated in Python; settings not listed (free-dimension overrides, custom op
# libraries) are NOT carried into the build.
_CARRIED_CONFIG_KEYS = (
    "optimization.disable_specified_optimizers",
    "optimization.enable_gelu_approximation",
    "optimization.enable_cast_chain_elimination",
    "session.disable_quant_qdq",
    "session.disable_double_qdq_remover",
    "session.disable_qdq_constant_folding",
    "session.enable_quant_qdq_cleanup",
    "session.disable_aot_function_inlining",
    "session.enable_dq_matmulnbits_fusion",
    "session.qdq_matmulnbits_accuracy_level",
    "session.qdq_matmulnbits_block_size",
    "session.set_denormal_as_zero",
    "mlas.disable_kleidiai",
    "mlas.use_lut_gemm",
)


class CpuRoute(enum.Enum):
    """How a pool gives its CPU sessions their weights."""

    PREPACKED_FILE = "prepacked-file"
    """Sessions load :attr:`PrepackedModel.model_path` after :meth:`PrepackedModel.apply`: raw,
    derived and packed weights are mapped from one file, once for all sessions; packed speed."""

    SHARED_RAW = "shared-raw"
    """Sessions borrow the raw weights zero-copy with ``session.disable_prepacking=1``: one copy,
    near-zero session creation time, unpacked kernels."""


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
    """

    external_initializers: int
    raw_bytes: int
    prepacked_blobs: int
    prepacked_bytes: int
    derived_bytes: int
    unaligned_blobs: int
    maps_per_session: int


@dataclasses.dataclass(frozen=True)
class CpuRouteDecision:
    """The route :func:`choose_cpu_route` picked, and why (one sentence, for logs and reports)."""

    route: CpuRoute
    reason: str


@dataclasses.dataclass(frozen=True)
class PrepackedModel:
    """An optimized model whose data file carries ORT's prepacked weights, to load N times.

    Attributes:
        model_path: The optimized model. Pass ``str(model_path)`` to ``InferenceSession``: ORT
            must open the data file itself (from bytes, set
            ``session.model_external_initializers_file_folder_path`` to ``model_path.parent``).
        data_path: Its data file (raw and derived initializers, prepacked blobs), next to it.
        key: The cache key of this entry (hex).
        stats: What the data file holds.
    """

    model_path: Path
    data_path: Path
    key: str
    stats: PrepackStats

    def apply(self, so: ort.SessionOptions) -> None:
        """Set what a session needs to load this model with shared prepacked weights.

        Nothing has to be kept alive for the session: ORT maps ``data_path`` itself.

        * ``graph_optimization_level = ORT_DISABLE_ALL``: the graph is already optimized at the
          level the key records; running the optimizers again is redundant work per session
          (measured on the MLP and BERT-base: same memory, creation time within this VM's noise).
        * ``session.disable_prepacking = 0``, where the options said otherwise: with prepacking
          off the kernels ignore the blobs and run unpacked (MLP, batch 8: 38.8 instead of 17.3
          CPU ms per run).
        * Deliberately not set, and not to be set by the caller either:
          ``add_external_initializers_from_files_in_memory`` for this file (ORT then ignores the
          blobs and each session packs a private copy: 4 MLP sessions, 965 instead of 199 MiB),
          nor a weight store's registration for the *source* model's weights file (this model
          does not read it).

        Memory options (``enable_cpu_mem_arena``, ``enable_mem_pattern``,
        ``session.use_device_allocator_for_initializers``, ``session.use_env_allocators``, thread
        settings) are the caller's: none changed what this route leaves per session, beyond the
        ~1 MiB first arena chunk (see :func:`release_freed_heap` for what does matter).

        Args:
            so: The options of ONE session, modified in place.
        """
        import onnxruntime as ort

        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        if _config_entry(so, "session.disable_prepacking") not in (None, "0"):
            so.add_session_config_entry("session.disable_prepacking", "0")


def build_prepacked_model(
    prepared_model: str | os.PathLike[str],
    weights_file: str | os.PathLike[str] | None,
    cache_dir: str | os.PathLike[str],
    *,
    sess_options: ort.SessionOptions | None = None,
    weights_digest: str | None = None,
    min_external_bytes: int = _DEFAULT_MIN_EXTERNAL_BYTES,
) -> PrepackedModel:
    """Return the cached prepacked form of ``prepared_model``, building it first if needed.

    A build creates one CPU session over ``prepared_model`` that saves its optimized graph with
    ``session.save_external_prepacked_constant_initializers=1`` into a private temporary folder in
    ``cache_dir``, reloads the result once as :meth:`PrepackedModel.apply` would (ORT validates
    every blob against a fresh pack, so a bad entry fails here and not in the pool), makes the
    files read-only, and renames the folder into place with ``os.replace``. A reader therefore
    never sees half an entry, and of concurrent builders of one key one wins. A build costs about
    one fully optimized session creation, one reload and ~2x the weights written to disk (MLP:
    1.6-4 s on 2 busy cores, a 384 MiB data file; BERT-base: 1.9-3.8 s, a 738 MiB data file).

    The key covers what changes the bytes ORT writes or whether an ORT would accept them: this
    cache's format, the onnxruntime version and build, the CPU (vendor, model and ISA flags: MLAS
    picks its packed layout by ISA), the prepared model's bytes, the weights (``weights_digest``,
    or a SHA-256 of ``weights_file``) and their size, the optimization level, the carried config
    entries and ``min_external_bytes``.

    Args:
        prepared_model: A model whose large initializers are external data in ``weights_file``
            (small ones may be inline; it may also have no external data at all).
        weights_file: The one external data file ``prepared_model`` refers to, or None if it has
            none. ORT reads it zero-copy through a read-only map registered under the name the
            model uses, so it need not sit where the model's ``location`` points.
        cache_dir: Where entries live, one folder per key (e.g. ``sharedml.cache_dir() /
            "prepacked"``); created if missing.
        sess_options: The options the pool gives its sessions. Only the graph optimization level
            and the config entries that change the optimized graph are used (see
            ``_CARRIED_CONFIG_KEYS``); free-dimension overrides and custom ops are not carried.
            None means ORT's defaults (ORT_ENABLE_ALL, which bakes NCHWc layouts for this CPU into
            the graph; the key already names the CPU).
        weights_digest: A content digest of ``weights_file`` that the caller already has (a
            prepared model's manifest records its SHA-256). Without it the file is hashed on
            every call (about 1 s per GB).
        min_external_bytes: Initializers smaller than this stay inline in the saved model (see
            ``_DEFAULT_MIN_EXTERNAL_BYTES`` for why).

    Returns:
        The entry; its ``stats`` feed :func:`choose_cpu_route`.

    Raises:
        ValueError: ``sess_options`` sets ``session.disable_prepacking=1``, or the model has
            external data and ``weights_file`` is None.
        ModelNotFoundError: ``prepared_model`` or ``weights_file`` does not exist.
        ExternalDataError: ``prepared_model`` refers to more than one external data file.
        SessionCreationError: onnxruntime could not build or reload the model; no entry is kept.

    Thread-safety: safe to call concurrently, also from several processes sharing ``cache_dir``.
    Leaves the process's heap trimmed (:func:`release_freed_heap`) after a build.
    """
    import onnxruntime as ort

    prepared_model = Path(prepared_model)
    cache_dir = Path(cache_dir)
    try:
        model_bytes = prepared_model.read_bytes()
    except FileNotFoundError:
        raise ModelNotFoundError(
            f"Model '{prepared_model}' does not exist. Pass the path of a prepared model."
        ) from None
    source = onnx.load_model_from_string(model_bytes)
    location = _single_external_location(source, prepared_model)
    if location is not None and weights_file is None:
        raise ValueError(
            f"Model '{prepared_model}' keeps weights in the external file '{location}', but "
            "weights_file is None. Pass the path of that file."
        )
    level, carried = _build_settings(sess_options)
    weights_size = 0
    if weights_file is not None:
        weights_file = Path(weights_file)
        try:
            weights_size = weights_file.stat().st_size
        except FileNotFoundError:
            raise ModelNotFoundError(
                f"Weights file '{weights_file}' of model '{prepared_model}' does not exist."
            ) from None
        if weights_digest is None:
            weights_digest = "sha256:" + sha256_of(weights_file)
    key_material = {
        "format": _FORMAT,
        "ort_version": ort.__version__,
        "ort_build": _ort_build_info(),
        "cpu": _cpu_fingerprint(),
        "model_sha256": hashlib.sha256(model_bytes).hexdigest(),
        "weights_digest": weights_digest,
        "weights_size": weights_size,
        "optimization_level": int(level),
        "config": carried,
        "min_external_bytes": min_external_bytes,
    }
    key = hashlib.sha256(json.dumps(key_material, sort_keys=True).encode()).hexdigest()[:32]
    final = cache_dir / key
    cached = _load_entry(final, key)
    if cached is not None:
        return cached

    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key[:16]}-", suffix=".tmp", dir=cache_dir))
    try:
        so = ort.SessionOptions()
        so.graph_optimization_level = level
        # At ORT_ENABLE_ALL, ORT warns that the saved model is hardware-specific: expected here
        # (the key names the CPU), so only errors are logged.
        so.log_severity_level = 3
        for k, v in carried.items():
            so.add_session_config_entry(k, v)
        so.optimized_model_filepath = str(tmp / _MODEL_NAME)
        so.add_session_config_entry(
            "session.optimized_model_external_initializers_file_name", _DATA_NAME
        )
        so.add_session_config_entry(
            "session.optimized_model_external_initializers_min_size_in_bytes",
            str(min_external_bytes),
        )
        so.add_session_config_entry("session.save_external_prepacked_constant_initializers", "1")
        weights_map: Any = None
        if location is not None and weights_file is not None:
            import numpy as np

            weights_map = np.memmap(weights_file, dtype=np.uint8, mode="r")
            so.add_external_initializers_from_files_in_memory(
                [location], [weights_map], [weights_map.nbytes]
            )
            so.add_session_config_entry(
                "session.use_external_initializer_file_buffers_directly", "1"
            )
        try:
            ort.InferenceSession(str(prepared_model), so, providers=["CPUExecutionProvider"])
            if not (tmp / _DATA_NAME).exists():  # nothing was large enough to go external
                (tmp / _DATA_NAME).write_bytes(b"")
            _drop_sharedml_metadata(tmp / _MODEL_NAME, key)
            stats = inspect_prepacked_model(tmp / _MODEL_NAME, source_model=source)
            check = ort.SessionOptions()
            PrepackedModel(tmp / _MODEL_NAME, tmp / _DATA_NAME, key, stats).apply(check)
            ort.InferenceSession(str(tmp / _MODEL_NAME), check, providers=["CPUExecutionProvider"])
        except Exception as exc:
            raise SessionCreationError(
                f"onnxruntime could not save or reload the prepacked form of '{prepared_model}': "
                f"{exc}. Use the shared-raw route for this model."
            ) from exc
        finally:
            del weights_map
        meta = {"key": key, "key_material": key_material, "stats": dataclasses.asdict(stats)}
        (tmp / _META_NAME).write_text(json.dumps(meta, indent=1, sort_keys=True))
        for name in (_MODEL_NAME, _DATA_NAME, _META_NAME):
            # A mapped file truncated or rewritten under a running process crashes it (SIGBUS).
            os.chmod(tmp / name, _READ_ONLY_FILE_MODE)
        try:
            os.replace(tmp, final)
        except OSError:
            # The target exists: another builder published this key first (use theirs), or it
            # is an unreadable leftover, which is moved aside (sessions that map its files keep
            # their mappings) so that ours can take its place.
            if _load_entry(final, key) is None:
                stale = Path(tempfile.mkdtemp(prefix=f".{key[:16]}-", suffix=".tmp", dir=cache_dir))
                os.replace(final, stale / "stale")
                os.replace(tmp, final)
                shutil.rmtree(stale, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    release_freed_heap()  # the two sessions above freed about twice the weights into the heap
    entry = _load_entry(final, key)
    if entry is None:  # pragma: no cover - only if someone deletes the entry meanwhile
        raise SessionCreationError(f"The prepacked cache entry '{final}' vanished after its build.")
    return entry


def inspect_prepacked_model(
    model_path: str | os.PathLike[str], *, source_model: onnx.ModelProto | None = None
) -> PrepackStats:
    """Count what a saved prepacked model's data file holds, from its protobuf alone.

    Args:
        model_path: A model saved with ``session.save_external_prepacked_constant_initializers=1``
            (or any model: one without blobs reports ``prepacked_blobs=0``).
        source_model: The model it was optimized from (external data not loaded), to tell
            initializers the optimizers made (``derived_bytes``); None reports 0 for those.

    Returns:
        The figures :func:`choose_cpu_route` decides on.
    """
    model = onnx.load(str(model_path), load_external_data=False)
    source_names = _tensor_names(source_model.graph) if source_model is not None else None
    external = raw = blobs = packed = derived = unaligned = maps = 0
    for name, tensor in _named_tensors(model.graph):
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        external += 1
        own_blobs = length = 0
        for entry in tensor.external_data:
            if entry.key == "length":
                length = int(entry.value)
            elif entry.key.startswith("prepacked_"):
                # "<op type>+<hash>|<offset>;<size>;<checksum>|<offset>;<size>;<checksum>..."
                for part in entry.value.split("|")[1:]:
                    offset, size = (int(v) for v in part.split(";")[:2])
                    own_blobs += 1
                    packed += size
                    unaligned += offset % _PAGE_BYTES != 0
        raw += length
        blobs += own_blobs
        if source_names is not None and name not in source_names:
            derived += length
        # A session maps each blob; the raw data of a packed weight is read, packed to check the
        # blob, and dropped, so it is not mapped; an unpacked initializer is mapped once.
        maps += own_blobs if own_blobs else 1
    return PrepackStats(external, raw, blobs, packed, derived, unaligned, maps)


def choose_cpu_route(
    stats: PrepackStats, *, sessions: int, max_map_count: int | None = None
) -> CpuRouteDecision:
    """Pick the CPU weight route for ``sessions`` sessions of one model.

    PREPACKED_FILE wherever ORT packs or derives anything. Memory is then about that of SHARED_RAW
    (MLP, 8 sessions: 208 vs 197 MiB; BERT-base, 4: 429 vs 361, the difference mostly clean page
    cache of the embedding table that ORT's own map faults in), or far less where optimizers
    derive weights (ResNet-50, 4 sessions: 135 vs 494 MiB at ORT's default level). Packed kernels
    are faster as soon as a MatMul has more than one row (4 sessions x 4 threads, CPU ms per run:
    MLP batch 8 17.3 vs 38.8, 100 MiB MLP batch 8 8.8 vs 20.1, BERT-base batch 1 x 64 tokens 96
    vs 157) and even at one row (MLP batch 1: 14.1 vs 13.7). The costs are disk (~2x the
    weights), a one-off build, and slower session creation (ORT packs again to validate: MLP
    0.1-0.3 s per session against ~0.01 s); hence SHARED_RAW when there is nothing to gain, or
    when the file maps of all sessions would crowd the kernel's per-process map limit.

    Args:
        stats: From :func:`inspect_prepacked_model` or ``PrepackedModel.stats``.
        sessions: How many sessions of this model the process will hold at most.
        max_map_count: The per-process memory-map limit; None reads
            ``/proc/sys/vm/max_map_count`` (65530 where unreadable).

    Returns:
        The route and a one-sentence reason.
    """
    if stats.prepacked_bytes == 0 and stats.derived_bytes == 0:
        return CpuRouteDecision(
            CpuRoute.SHARED_RAW,
            "ORT neither prepacks nor derives any weight of this model on this CPU, so the saved "
            "copy would only double the disk use and slow session creation.",
        )
    limit = max_map_count if max_map_count is not None else _max_map_count()
    maps = stats.maps_per_session * sessions
    if maps > limit // 2:  # leave half the limit to the rest of the process
        return CpuRouteDecision(
            CpuRoute.SHARED_RAW,
            f"{sessions} sessions would make {maps} memory maps of the data file, over half of "
            f"vm.max_map_count ({limit}); raise min_external_bytes or vm.max_map_count.",
        )
    return CpuRouteDecision(
        CpuRoute.PREPACKED_FILE,
        f"{stats.prepacked_blobs} prepacked blobs ({stats.prepacked_bytes / 2**20:.0f} MiB) and "
        f"{stats.derived_bytes / 2**20:.0f} MiB of optimizer-made weights are mapped once for "
        "every session.",
    )


def release_freed_heap() -> bool:
    """Give heap pages freed during session creation back to the OS (glibc ``malloc_trim(0)``).

    Why: ORT frees the packs and raw copies it makes while loading, but glibc keeps their pages
    (after the first large free it raises its mmap threshold, so later 16 MiB buffers come from
    the heap and stay there once freed). MLP, 8 sessions on the prepacked route: PSS growth
    661 MiB before, 207 MiB after. No session option removes it (arena off,
    ``use_device_allocator_for_initializers``, ``use_env_allocators``, memory patterns off, one
    intra-op thread, global thread pool: 532-706 MiB). It takes milliseconds; call it after
    creating a batch of sessions. ``mallopt(M_MMAP_THRESHOLD, 128 KiB)`` at startup also works
    (198 MiB) but changes allocation for the whole process.

    Returns:
        True if memory was released; False if none was, or the C library is not glibc.

    Thread-safety: may be called from any thread at any time.
    """
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False


@functools.cache
def _malloc_trim() -> Any:
    """The C library's ``malloc_trim``, looked up once (``find_library`` runs ``ldconfig``)."""
    if platform.system() != "Linux":
        return None
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # musl and other C libraries have no malloc_trim
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


# --------------------------------------------------------------------------------------------
# Helpers


def _load_entry(directory: Path, key: str) -> PrepackedModel | None:
    try:
        meta = json.loads((directory / _META_NAME).read_text())
        stats = PrepackStats(**meta["stats"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    model, data = directory / _MODEL_NAME, directory / _DATA_NAME
    if meta.get("key") != key or not model.is_file() or not data.is_file():
        return None
    return PrepackedModel(model, data, key, stats)


def _drop_sharedml_metadata(model_path: Path, key: str) -> None:
    """Replace the source's ``sharedml.*`` metadata (its weights manifest) with this entry's key.

    ORT copies the prepared model's metadata into the saved one, but the manifest describes a
    weights file this model does not read: ``WeightStore.open`` or the prepare cache would take
    the saved model for a prepared one and look for (and verify) the wrong file.
    """
    model = onnx.load(str(model_path), load_external_data=False)
    kept = [p for p in model.metadata_props if not p.key.startswith("sharedml.")]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    model.metadata_props.add(key="sharedml.prepacked", value=json.dumps({"key": key}))
    # Raw bytes, not onnx.save: only the graph is rewritten, the data file is left as ORT wrote it.
    model_path.write_bytes(model.SerializeToString())


def _config_entry(so: Any, key: str) -> str | None:
    try:
        value: str = so.get_session_config_entry(key)
    except RuntimeError:  # ORT raises for a key that was never set
        return None
    return value


def _build_settings(sess_options: Any | None) -> tuple[Any, dict[str, str]]:
    import onnxruntime as ort

    if sess_options is None:
        return ort.GraphOptimizationLevel.ORT_ENABLE_ALL, {}
    if _config_entry(sess_options, "session.disable_prepacking") == "1":
        raise ValueError(
            "sess_options sets session.disable_prepacking=1, but the prepacked route exists to "
            "keep prepacking on. Use the shared-raw route, or drop that entry."
        )
    carried = {
        k: v for k in _CARRIED_CONFIG_KEYS if (v := _config_entry(sess_options, k)) is not None
    }
    return sess_options.graph_optimization_level, carried


def _single_external_location(model: onnx.ModelProto, path: Path) -> str | None:
    locations = {
        entry.value
        for _, tensor in _named_tensors(model.graph)
        if tensor.data_location == onnx.TensorProto.EXTERNAL
        for entry in tensor.external_data
        if entry.key == "location"
    }
    if len(locations) > 1:
        raise ExternalDataError(
            f"Model '{path}' refers to {len(locations)} external data files "
            f"({', '.join(sorted(locations))}); the prepacked route takes a model prepared into "
            "one weights file. Run sharedml.prepare on it first."
        )
    return next(iter(locations), None)


def _named_tensors(graph: onnx.GraphProto) -> Iterator[tuple[str, onnx.TensorProto]]:
    """(name, tensor) of every initializer and Constant value, in ``graph`` and its subgraphs."""
    for tensor in graph.initializer:
        yield tensor.name, tensor
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR:
                name = node.output[0] if node.op_type == "Constant" and node.output else attr.t.name
                yield name, attr.t
            elif attr.type == onnx.AttributeProto.GRAPH:
                yield from _named_tensors(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for g in attr.graphs:
                    yield from _named_tensors(g)


def _tensor_names(graph: onnx.GraphProto) -> set[str]:
    return {name for name, _ in _named_tensors(graph)}


def _ort_build_info() -> str:
    import onnxruntime as ort

    get = getattr(ort, "get_build_info", None)
    return str(get()) if get is not None else ""


def _cpu_fingerprint() -> str:
    """Vendor, model and ISA flags of the first CPU: blobs are valid for that ISA only."""
    try:
        fields: dict[str, str] = {}
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if not line.strip():
                    break  # the first processor's block is enough
                k, _, v = line.partition(":")
                fields[k.strip()] = v.strip()
    except OSError:
        return f"{platform.machine()}|{platform.processor()}"
    text = "|".join(fields.get(k, "") for k in ("vendor_id", "model name", "flags", "Features"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _max_map_count() -> int:
    try:
        return int(Path("/proc/sys/vm/max_map_count").read_text())
    except (OSError, ValueError):
        return 65530

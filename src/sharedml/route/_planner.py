"""The route planner: one place decides how a pool's sessions get their weights.

``plan_route(open_model(model, ...), options)`` takes a model, prepared and opened once, and
the caller's settings (:class:`~sharedml.route._options.RouteOptions`) and returns a
:class:`SessionRecipe`: the prepared model and its graph, the weights mapped once for the
process, the :class:`~sharedml.route.Mechanism` that lends them to ORT, why that one, and
everything needed to build one session's options and create it. A pool only holds the
recipe; every routing rule is here.

The rules, in order:

1. The model is prepared (cached by content), its graph parsed once and its weights file
   mapped once per process (:func:`open_model`: :func:`sharedml.prepared_model_for`,
   :class:`sharedml.weights.WeightStore`). Whatever reads the model later reads that graph.
2. On CUDA weights go to the device once and every session borrows the device buffers
   (:class:`~sharedml.route.Mechanism` ``DEVICE``), if a route probed in a child process works with
   the installed ORT; otherwise sessions use host weights, with a warning. Where the provider
   table says no device route can work (DirectML, WebGPU, other plugin EPs: their weights
   route is ``ort-mmap``), every session uploads its own device copy, and ORT loads the
   weights from the file (``ORT_MMAP``), which holds no host copy after the upload; the
   reason says so, without a warning (a pool of one session is their default anyway).
3. On the CPU, with ``prepacking`` ``auto`` or ``shared``, sessions load ORT's saved
   optimized form of the model where ORT packs or derives any weight: ``PREPACKED_FILE`` where
   it holds prepacked blobs (one copy of the packed weights too), ``OPTIMIZED_FILE`` where ORT
   packs nothing but its optimizers derive weights (fused Conv+BN, folded dequantization: one
   copy of those). Otherwise raw weights are borrowed zero-copy by the best host mechanism
   measured on this ORT (``IN_MEMORY_FILE``, ``ADD_INITIALIZER``, ``ORT_MMAP``), with
   prepacking off unless ``prepacking="per-session"``.
4. With ``prepacking="off"`` only the raw weights are shared. Where ORT's optimizers derive
   weights, every session derives and keeps its own copy of those: the pool warns and says so
   in its reason (the saved optimized model, built once into the cache, tells).
5. Each CPU session gets ``cores // max_sessions`` intra-op threads unless the template sets a
   count: N sessions that each use every core oversubscribe the CPU. A session's thread count
   can change the numerics of some kernels (dynamic quantization: ``DynamicQuantizeLSTM``,
   ``MatMulInteger``'s dynamically quantized inputs); outputs then differ from a plain session
   with ORT's default thread count, and equal a plain session given the same count.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sharedml._errors import (
    CacheError,
    ProviderError,
    SessionCreationError,
    SharedMLError,
    UnsupportedModelError,
)
from sharedml._host._platform import release_freed_heap, usable_cores
from sharedml.cache._root import Cache
from sharedml.model._graph import iter_graphs, load_graph
from sharedml.prepared._compress import WeightsFormat, compressed_model_for
from sharedml.prepared._prepare import prepared_model_from_bytes, prepared_model_with_graph
from sharedml.route._cpu import CpuRoute, choose_cpu_route
from sharedml.route._options import (
    Mechanism,
    Prepacking,
    RouteOptions,
    WeightsSettings,
)
from sharedml.runtime._capabilities import capability
from sharedml.runtime._errors import is_model_refused, refused_model_error
from sharedml.runtime._options import clone_session_options, config_entry
from sharedml.runtime._providers import (
    CPU,
    CUDA,
    ProviderFacts,
    ProviderPlan,
    WeightsRoute,
    graphs_unavailable,
)
from sharedml.weights._store import WeightStore, zero_copy_mechanisms

if TYPE_CHECKING:  # the message classes load on first parse, not on import
    from sharedml.model._proto import ModelProto

__all__ = ["OpenedModel", "SessionRecipe", "open_model", "plan_route"]


@dataclasses.dataclass(frozen=True, eq=False)
class SessionRecipe:
    """Everything a pool needs to create sessions that share one copy of the weights.

    Attributes:
        source_path: The model as the caller gave it.
        model_path: The prepared model (``source_path`` itself if prepare wrote it).
        graph: ``model_path``'s graph (external data not loaded: nodes and small tensors),
            parsed once for the pool (:func:`open_model`); whatever reads the model after
            that reads this, never the file again. Shared: never modified.
        load_path: The file each session loads: the prepared model, or its prepacked form.
        mechanism: How sessions get the weights.
        reason: Why this mechanism, in one or two sentences (``pool.mechanism_reason``).
        plan: The providers and the settings they need.
        weights: The host weights, mapped once for the process.
        prepacking: The prepacking setting the route was planned for.
        intra_op_threads: Intra-op threads per session where the template sets none, or None
            to leave ORT's default.
        device_store: The device copy of the weights (``DEVICE``), else None.
        prepacked: The saved optimized model (``PREPACKED_FILE``, ``OPTIMIZED_FILE``), else
            None.
        runtime_stats: What ORT's optimized form of the model holds
            (:class:`sharedml.weights._prepacked.PrepackStats`: derived and packed bytes) where the
            planner read it, else None.
        template: The caller's ``SessionOptions`` template (never modified).
        configure: Called with each session's options before creation.
        cache: The cache the route was planned with (resolved once by :func:`plan_route`):
            whatever the pool builds later goes there too.
    """

    source_path: Path
    model_path: Path
    graph: ModelProto
    load_path: Path
    mechanism: Mechanism
    reason: str
    plan: ProviderPlan
    weights: WeightStore
    prepacking: Prepacking
    intra_op_threads: int | None
    device_store: Any = None
    prepacked: Any = None
    runtime_stats: Any = None
    template: Any = None
    configure: Callable[[Any], None] | None = None
    cache: Cache | None = None

    def options(self) -> Any:
        """A fresh ``SessionOptions`` for one session of this recipe."""
        import onnxruntime as ort

        so = clone_session_options(self.template)
        if self.intra_op_threads is not None and so.intra_op_num_threads == 0:
            so.intra_op_num_threads = self.intra_op_threads
        if self.prepacked is not None:
            self.prepacked.apply(so)
        elif (
            self.prepacking is not Prepacking.AUTO
            or config_entry(so, "session.disable_prepacking") is None
        ):
            # Raw weights shared: prepacking off unless asked for, since with it on every
            # session packs a private copy of each MatMul/Conv weight, exactly the memory the
            # pool exists to save.
            off = "0" if self.prepacking is Prepacking.PER_SESSION else "1"
            so.add_session_config_entry("session.disable_prepacking", off)
        for key, value in self.plan.config_entries:
            if config_entry(so, key) is None:
                so.add_session_config_entry(key, value)
        if self.plan.disable_mem_pattern:
            so.enable_mem_pattern = False
        if self.plan.sequential_execution:
            so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        if self.device_store is not None:
            self.device_store.register(so)
        elif self.prepacked is None:
            # (The prepacked model is loaded by path: ORT must map its data file itself, or it
            # ignores the prepacked blobs; see PrepackedModel.apply.)
            self.weights.register(so, self.mechanism.value)
        if self.configure is not None:
            self.configure(so)
            if _has_providers(so):
                raise ProviderError(
                    f"configure added execution providers to the session options of "
                    f"'{self.source_path}' (add_provider_for_devices or add_provider): the pool "
                    f"creates its sessions with {self.plan.primary}, so those would be ignored or "
                    "would run the sessions on a provider the pool did not plan for. Pass the "
                    "provider to the pool instead: providers=[NAME] (or an OrtEpDevice), with "
                    "ep_devices= to choose its device."
                )
        return so

    def create_session(
        self, *, dims: Mapping[str, int] | None = None, cuda_graph: bool = True
    ) -> Any:
        """Create one ``onnxruntime.InferenceSession`` of this recipe.

        Args:
            dims: Symbolic dims to fix (``add_free_dimension_override_by_name``), name -> value.
            cuda_graph: False: ``enable_cuda_graph`` off whatever the plan says (a session that
                only reports the model's inputs and outputs).

        Raises:
            SessionCreationError: onnxruntime refused; the message names the model and providers.
        """
        import onnxruntime as ort

        so = self.options()
        for name, value in (dims or {}).items():
            so.add_free_dimension_override_by_name(name, value)
        plan = self.plan
        if not cuda_graph:
            plan = dataclasses.replace(
                plan,
                provider_options=tuple(
                    {k: v for k, v in o.items() if k != "enable_cuda_graph"}
                    for o in plan.provider_options
                ),
            )
        try:
            sess = ort.InferenceSession(str(self.load_path), so, **plan.session_kwargs(so))
        except SharedMLError:
            raise
        except Exception as exc:
            if is_model_refused(exc):
                raise refused_model_error(exc, str(self.source_path)) from exc
            raise SessionCreationError(
                f"onnxruntime could not create a session for '{self.source_path}' (prepared as "
                f"'{self.model_path}') with {list(self.plan.providers)} ({self.plan.device}): "
                f"{exc}"
            ) from exc
        plan.check_session(sess, f"A session of '{self.source_path}'")
        if self.prepacked is not None:
            # ORT packs every weight again at load to validate the mapped blobs, then frees
            # that work; glibc keeps the freed pages unless trimmed.
            release_freed_heap()
        return sess


def _has_providers(so: Any) -> bool:
    """Whether ``so`` has execution providers added (``SessionOptions.has_providers``, 1.23+)."""
    has = getattr(so, "has_providers", None)
    return bool(has()) if callable(has) else False


@dataclasses.dataclass(frozen=True, eq=False)
class OpenedModel:
    """A pool's model, prepared, parsed once and mapped once: what the planner routes.

    Attributes:
        source_path: The model as the caller gave it (``<model bytes>`` for bytes).
        model_path: The prepared model (compressed where asked), whose weights the sessions
            share.
        graph: ``model_path``'s graph, external data not loaded; never modified.
        weights: Its host weights, mapped once for the process.
        cache: The cache it was found or built in (resolved once).
        weights_format: ``FLOAT``, or the format ``model_path`` was compressed to.
    """

    source_path: Path
    model_path: Path
    graph: ModelProto
    weights: WeightStore
    cache: Cache
    weights_format: WeightsFormat = WeightsFormat.FLOAT


def open_model(model: str | os.PathLike[str] | bytes, settings: WeightsSettings) -> OpenedModel:
    """Rule 1: prepare ``model`` (cached by content), parse its graph once, map its weights.

    Args:
        model: Any ONNX model path, or a model's bytes (without external data).
        settings: Where the weights come from: the cache (resolved once here; the opened model
            carries it), whether to verify them, prepare's threshold, and the weights format
            (compressed formats are built once into the cache from the prepared float model:
            :mod:`sharedml.prepared._compress`).

    Raises:
        SharedMLError: the model, its weights or the cache cannot be used.
    """
    cache = Cache.at(settings.cache_dir)
    compressed, verify_weights = settings.weights_format, settings.verify_weights
    threshold = settings.size_threshold_bytes
    kwargs: dict[str, Any] = {} if threshold is None else {"size_threshold_bytes": threshold}
    graph: ModelProto | None = None  # where finding the prepared model parsed it already
    if isinstance(model, (bytes, bytearray, memoryview)):
        source = Path("<model bytes>")
        model_path = prepared_model_from_bytes(
            bytes(model), cache_dir=cache, verify=verify_weights, **kwargs
        )
    elif isinstance(model, (str, os.PathLike)):
        source = Path(model)
        model_path, graph = prepared_model_with_graph(
            source, cache_dir=cache, verify=verify_weights, **kwargs
        )
    else:
        raise TypeError(
            f"model must be a path (str or os.PathLike) or the model's bytes, not "
            f"{type(model).__name__}."
        )
    if compressed is not WeightsFormat.FLOAT:  # compressed once from the prepared float model
        model_path = compressed_model_for(
            model_path,
            weights=compressed,
            cache_dir=cache,
            verify=verify_weights,
            source=source,
            graph=graph,
        )
        graph = None  # the compressed model's graph is another one
    if graph is None:
        graph = load_graph(model_path)  # the one parse of the graph the sessions load
    store = WeightStore.open(model_path, verify=verify_weights, cache_dir=cache, model=graph)
    return OpenedModel(source, model_path, graph, store, cache, compressed)


def plan_route(model: OpenedModel, options: RouteOptions) -> SessionRecipe:
    """Decide how ``options.max_sessions`` sessions of ``model`` get their weights (the module).

    Args:
        model: The model, opened by :func:`open_model` (with ``options.weights``).
        options: The providers, the most sessions, each session's settings and the weights'.

    Returns:
        The recipe.

    Raises:
        ValueError: a combination of settings that contradicts itself.
        ProviderError: ``mechanism="device"`` and no device route works here.
        SharedMLError: the model, its weights or the cache cannot be used.
    """
    plan, graphs_reason = _without_unusable_graphs(options.plan)
    recipe = _plan(model, dataclasses.replace(options, plan=plan))
    if graphs_reason:
        recipe = dataclasses.replace(recipe, reason=f"{recipe.reason} {graphs_reason}".strip())
    return recipe


def _without_unusable_graphs(plan: ProviderPlan) -> tuple[ProviderPlan, str]:
    """The plan without ``enable_cuda_graph`` where graphs cannot run here, and why."""
    why = graphs_unavailable(plan.primary, plan.provider_options[0])
    if not why:
        return plan, ""
    options = list(plan.provider_options)
    options[0] = {k: v for k, v in options[0].items() if k != "enable_cuda_graph"}
    return (
        dataclasses.replace(plan, provider_options=tuple(options)),
        f"CUDA graphs are off: {why}.",
    )


def _plan(opened: OpenedModel, options: RouteOptions) -> SessionRecipe:
    """:func:`plan_route` for an opened model and a plan whose options can run here."""
    plan, max_sessions = options.plan, options.max_sessions
    sess_options, cores = options.session.sess_options, options.session.cores
    requested, packing = options.weights.mechanism, options.weights.prepacking
    verify_weights = options.weights.verify_weights
    model_path, weights, compressed = opened.model_path, opened.weights, opened.weights_format
    if requested is Mechanism.IN_MEMORY_FILE and not capability("files-in-memory").available:
        raise ProviderError(
            f"mechanism='in-memory-file' cannot be used: {capability('files-in-memory').reason}. "
            "Use mechanism='auto', which picks what this onnxruntime can do."
        )
    common: dict[str, Any] = {
        "source_path": opened.source_path,
        "model_path": model_path,
        "graph": opened.graph,
        "plan": plan,
        "weights": weights,
        "prepacking": packing,
        "template": sess_options,
        "configure": options.session.configure,
        "cache": opened.cache,
        "intra_op_threads": (
            max(1, (cores or usable_cores()) // max_sessions) if plan.primary == CPU else None
        ),
    }

    facts = plan.facts
    if facts.weights is WeightsRoute.ORT_MMAP:
        return _own_copy_recipe(requested, common, facts)
    device_reason = ""
    if requested is Mechanism.DEVICE or (requested is None and plan.primary == CUDA):
        device_store, device_reason = _device_weights(weights, plan, forced=requested is not None)
        if device_store is not None:
            return SessionRecipe(
                load_path=model_path,
                mechanism=Mechanism.DEVICE,
                reason=device_reason,
                device_store=device_store,
                **common,
            )
    host = (
        Mechanism(zero_copy_mechanisms()[0]) if requested in (None, Mechanism.DEVICE) else requested
    )
    if (
        plan.primary == CPU
        and requested is None
        and packing in (Prepacking.AUTO, Prepacking.SHARED)
    ):
        # Block-quantized MatMuls (compressed here, or quantized before they came to us) run on
        # packed weights only: where the shared packed form cannot be used, each session packs.
        block_packs = packing is Prepacking.AUTO and (
            compressed is not WeightsFormat.FLOAT or _block_quantized(opened.graph)
        )
        prepacked, reason, packs = _prepacked_weights(
            opened,
            sess_options,
            max_sessions,
            forced=packing is Prepacking.SHARED,
            verify=verify_weights,
            instead=(
                "each session packs its own copy of the compressed weights instead"
                if block_packs
                else "the pool shares raw weights with prepacking off instead"
            ),
            block_quantized=block_packs,
        )
        if prepacked is not None:
            return SessionRecipe(
                load_path=prepacked.model_path,
                mechanism=(
                    Mechanism.PREPACKED_FILE
                    if prepacked.stats.prepacked_blobs
                    else Mechanism.OPTIMIZED_FILE
                ),
                reason=reason,
                prepacked=prepacked,
                runtime_stats=prepacked.stats,
                **common,
            )
        if block_packs or packs:
            # ORT packs weights that no saved model shares here (too small to be saved apart,
            # or MatMulNBits before 1.28): unpacked, those kernels compute other values than
            # plain ORT (a 1-D U-Net: 5.7e-6 away), so each session packs its own, as ORT does.
            # MatMulNBits unpacked ran 0.55x (int8) and 0.66x (int4) of its packed speed here
            # (onnxruntime 1.32; 1.30's int8 reload computed NaN, and unpacked ran 0.09x): the
            # compressed weights are a quarter or an eighth of the floats, so each session's
            # own packs cost less than one float copy for a pool of up to 4-8 sessions. Before
            # onnxruntime 1.28 this is every such pool: ORT saves no MatMulNBits pack.
            packing = Prepacking.PER_SESSION
            common["prepacking"] = packing
    else:
        reason = ""
    stats = None
    if plan.primary == CPU and packing is Prepacking.OFF and device_reason == "":
        stats, derived_reason = _derived_weights_check(opened, sess_options, verify=verify_weights)
        reason = " ".join(r for r in (reason, derived_reason) if r)
    reason = " ".join(r for r in (device_reason, reason, _host_reason(host, packing)) if r)
    return SessionRecipe(
        load_path=model_path, mechanism=host, reason=reason, runtime_stats=stats, **common
    )


def _block_quantized(model: ModelProto) -> bool:
    """Whether the model runs ORT's ``MatMulNBits`` (weights in blocks of a few bits)."""
    return any(n.op_type == "MatMulNBits" for g, _ in iter_graphs(model.graph) for n in g.node)


def _optimized_model(opened: OpenedModel, sess_options: Any, *, verify: bool) -> Any:
    """ORT's saved optimized (and prepacked) form of the model: a cache entry, built once."""
    from sharedml.weights import _prepacked as _prepack

    weights = opened.weights
    files = weights.manifest.files
    return _prepack.build_prepacked_model(
        weights.model_path,
        weights.path
        if len(files) == 1
        else {f.file: weights.model_path.parent / f.file for f in files},
        opened.cache,
        sess_options=sess_options,
        weights_digest="sha256:" + ",".join(f.sha256 for f in sorted(files, key=lambda f: f.file)),
        verify=verify,
        graph=opened.graph,
    )


def _derived_weights_check(
    opened: OpenedModel, sess_options: Any, *, verify: bool
) -> tuple[Any, str]:
    """For ``prepacking="off"``: does ORT derive weights that every session then keeps itself?

    Reads ORT's saved optimized form of the model (built once into the cache; the same entry
    the default route uses). Where ORT derives weights, warns and returns the sentence for the
    pool's reason. Never fails the pool: a model whose optimized form cannot be built gets a
    reason saying the check could not be made.
    """
    try:
        prepacked = _optimized_model(opened, sess_options, verify=verify)
    except CacheError:
        raise
    except (SharedMLError, ValueError) as exc:
        return None, f"Whether ORT derives weights of this model could not be checked ({exc})."
    derived = prepacked.stats.derived_bytes
    if not derived:
        return prepacked.stats, ""
    message = (
        f"prepacking='off' shares only the raw weights of '{opened.source_path}': ORT's "
        f"optimizers derive "
        f"{derived / 2**20:.1f} MiB of weights from them (fused, folded or dequantized), which "
        "every session derives and keeps for itself. prepacking='auto' (the default) shares "
        "those too."
    )
    warnings.warn(message, RuntimeWarning, stacklevel=4)
    return prepacked.stats, message


def _host_reason(mechanism: Mechanism, packing: Prepacking) -> str:
    how = {
        Mechanism.IN_MEMORY_FILE: "the mapped weights file is lent whole to every session",
        Mechanism.ADD_INITIALIZER: "each tensor is lent to every session from the mapped file",
        Mechanism.ORT_MMAP: "ORT maps the weights file in every session (one page-cache copy)",
    }.get(mechanism, str(mechanism))
    packs = (
        "each session packs a private copy of its packed weights (prepacking='per-session')"
        if packing is Prepacking.PER_SESSION
        else "prepacking is off, so kernels run on unpacked weights"
    )
    return f"Raw weights shared: {how}; {packs}."


# Providers whose sessions each hold their own device copy (DirectML, WebGPU, other plugin EPs:
# PROVIDER_FACTS' weights route "ort-mmap"). Of the host routes, ORT loading the weights from the
# file frees its host copy once uploaded; the in-memory file keeps the whole map resident for
# the pool's life, one more copy of the weights; add-initializer's tensors are copied too.
# Figures: docs/directml.md; on WebGPU 1.32 the host routes cost most (docs/webgpu.md).
_OWN_COPY_MECHANISM = Mechanism.ORT_MMAP


def _own_copy_recipe(
    requested: Mechanism | None, common: dict[str, Any], facts: ProviderFacts
) -> SessionRecipe:
    """A provider without a device route: a host mechanism, and each session's own device copy."""
    why = facts.no_device_route or f"{facts.provider} sessions cannot share device weights"
    if requested is Mechanism.DEVICE:
        raise ProviderError(
            f"mechanism='device' with {facts.provider}: {why}. Use mechanism='auto': one "
            "session with batching keeps one device copy."
        )
    host = requested or _OWN_COPY_MECHANISM
    how = {
        Mechanism.ORT_MMAP: (
            "ORT loads them from the prepared model's weights file and frees its host copy "
            "after the upload (the least memory measured on DirectML)"
        ),
        Mechanism.IN_MEMORY_FILE: (
            "the mapped weights file is lent to every session and stays resident for the "
            "pool's life, beside the device copies"
        ),
        Mechanism.ADD_INITIALIZER: (
            "each tensor is lent from the mapped file, and ORT copies it to the device "
            "(it warns that the user-supplied initializer's memory location differs)"
        ),
    }[host]
    reason = f"{why}. Host weights ({host.value}): {how}."
    return SessionRecipe(load_path=common["model_path"], mechanism=host, reason=reason, **common)


def _device_weights(weights: WeightStore, plan: ProviderPlan, *, forced: bool) -> tuple[Any, str]:
    """The device store for this plan, or (None, why not) after warning the caller."""
    from sharedml.weights import _device
    from sharedml.weights import _probe as _device_probe

    provider, device_id = plan.primary, plan.device_id
    has_store = provider in _device.DEVICE_TYPES and provider != CPU
    route = _device_probe.select_route(provider, device_id) if has_store else None
    if route is not None:
        store = _device.DeviceWeightStore.for_store(weights, provider, device_id, route=route)
        return store, (
            f"Weights uploaded once to {provider} device {device_id} (route '{route}', "
            f"{store.device_bytes / 2**20:.0f} MiB); every session borrows those buffers."
        )
    probes = _device_probe.probe_routes(provider, device_id) if has_store else ()
    tried = "; ".join(f"{p.route}: {p.reason}" for p in probes) or "nothing to try"
    if forced:
        raise ProviderError(
            f"No device weight route works for {provider} on device {device_id} with this "
            f"onnxruntime build ({tried}); use mechanism='auto' to fall back to host-mapped "
            "weights."
        )
    message = (
        f"Device weight sharing is unavailable for {provider} here ({tried}): every session "
        "will upload its own copy of the weights to the device."
    )
    warnings.warn(message, RuntimeWarning, stacklevel=4)
    return None, message


def _prepacked_weights(
    opened: OpenedModel,
    sess_options: Any,
    sessions: int,
    *,
    forced: bool,
    verify: bool,
    instead: str = "the pool shares raw weights with prepacking off instead",
    block_quantized: bool = False,
) -> tuple[Any, str, bool]:
    """The prepacked model where it pays (or is forced), else (None, why not, packs).

    ``instead`` says what the pool does where building it failed; ``packs``: ORT packs
    weights that no saved model shares, so raw-weight sessions should pack their own
    (:attr:`~sharedml.route._cpu.CpuRouteDecision.packs_per_session`).
    """
    saves = capability("prepacked-save")
    if not saves.available:
        # Not a failure: this onnxruntime has no such route, and the raw one is correct.
        if forced:
            raise SessionCreationError(
                f"prepacking='shared' needs ORT's saved prepacked model, but {saves.reason}. "
                "Use prepacking='auto' (raw weights shared) or a newer onnxruntime."
            )
        return None, f"The saved prepacked model is not used: {saves.reason}.", False
    try:
        prepacked = _optimized_model(opened, sess_options, verify=verify)
    except CacheError:
        raise  # an untrusted cache is the caller's to fix, on every route alike
    except UnsupportedModelError as exc:
        # Named by its prepared copy in the cache: say which model the caller gave. No route
        # would load it, so none is tried instead.
        cause = exc.__cause__ or exc
        raise refused_model_error(cause, str(opened.source_path)) from cause
    except SharedMLError as exc:
        if forced:
            raise
        warnings.warn(
            f"sharedml: sharing prepacked weights failed for '{opened.source_path}', {instead}: "
            f"{exc}",
            RuntimeWarning,
            stacklevel=4,
        )
        return None, f"The prepacked model could not be built ({exc}).", False
    decision = choose_cpu_route(prepacked.stats, sessions=sessions, block_quantized=block_quantized)
    if forced or decision.route is CpuRoute.PREPACKED_FILE:
        return prepacked, decision.reason, False
    return None, decision.reason, decision.packs_per_session

"""Session options: the one table of the ORT settings a pool carries from a caller's template.

ORT's Python ``SessionOptions`` can be neither copied nor enumerated, so a pool reads a known
set of public attributes and config keys from the caller's template and sets them on every
session's own options. :data:`CONFIG_KEYS` is that set, and for each key it says:

``copied``
    Set on every session the pool creates. Keys that are not copied would make each session
    do something once-per-process (write an optimized model file, say); the pool refuses a
    template that sets one instead of dropping it silently.
``changes_graph``
    Changes the optimized graph or the packed weights, so the prepacked route's build session
    copies it too and it is part of that build's cache key.

Settings outside the table (free-dimension overrides, custom op libraries) cannot be read back;
they go through the pool's ``configure`` callback, which is called with every session's options.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from sharedml._errors import ProviderError, SharedMLError

__all__ = [
    "CONFIG_KEYS",
    "COPIED_ATTRIBUTES",
    "ConfigKey",
    "clone_session_options",
    "config_entry",
    "graph_settings",
]


@dataclasses.dataclass(frozen=True)
class ConfigKey:
    """How the pool treats one ORT session config key (see the module docstring)."""

    copied: bool = True
    changes_graph: bool = False


_RUNTIME = ConfigKey()
_GRAPH = ConfigKey(changes_graph=True)
_PER_PROCESS = ConfigKey(copied=False)

CONFIG_KEYS: Mapping[str, ConfigKey] = {
    # What the optimizers do: changes the optimized graph.
    "optimization.disable_specified_optimizers": _GRAPH,
    "optimization.enable_gelu_approximation": _GRAPH,
    "optimization.enable_cast_chain_elimination": _GRAPH,
    "optimization.constant_folding_max_output_size_in_bytes": _GRAPH,
    "session.enable_quant_qdq": _GRAPH,
    "session.disable_quant_qdq": _GRAPH,
    "session.disable_double_qdq_remover": _GRAPH,
    "session.disable_qdq_constant_folding": _GRAPH,
    "session.enable_quant_qdq_cleanup": _GRAPH,
    "session.enable_dq_matmulnbits_fusion": _GRAPH,
    "session.qdq_matmulnbits_accuracy_level": _GRAPH,
    "session.qdq_matmulnbits_block_size": _GRAPH,
    "session.qdqisint8allowed": _GRAPH,
    "session.x64quantprecision": _GRAPH,
    "session.disable_aot_function_inlining": _GRAPH,
    "session.function_expansion_byte_limit": _GRAPH,
    "session.function_expansion_node_limit": _GRAPH,
    "session.set_denormal_as_zero": _GRAPH,  # constant folding computes with it
    # How MLAS packs weights: changes the packed blobs.
    "mlas.disable_kleidiai": _GRAPH,
    "mlas.use_lut_gemm": _GRAPH,
    "mlas.qnbit.force_fp32": _GRAPH,
    "mlas.enable_gemm_fastmath_arm64_bfloat16": _GRAPH,
    # Runtime behaviour of each session.
    "session.disable_prepacking": _RUNTIME,  # the route then decides, see _route
    "session.prepack.enable_parallel": _RUNTIME,
    "session.use_env_allocators": _RUNTIME,
    "session.use_device_allocator_for_initializers": _RUNTIME,
    "session.inter_op.allow_spinning": _RUNTIME,
    "session.intra_op.allow_spinning": _RUNTIME,
    "session.inter_op.spin_duration_us": _RUNTIME,
    "session.intra_op.spin_duration_us": _RUNTIME,
    "session.inter_op.spin_backoff_max": _RUNTIME,
    "session.intra_op.spin_backoff_max": _RUNTIME,
    "session.intra_op_thread_affinities": _RUNTIME,
    "session.dynamic_block_base": _RUNTIME,
    "session.force_spinning_stop": _RUNTIME,
    "session.strict_shape_type_inference": _RUNTIME,
    "session.allow_released_opsets_only": _RUNTIME,
    "session.disable_cpu_ep_fallback": _RUNTIME,
    "mlas.nchwc_depthwise_sliding": _RUNTIME,
    "mlas.nchwc_pointwise_conv_max_input_channel_batch": _RUNTIME,
    "mlas.kleidiai.conv_igemm_max_work": _RUNTIME,
    "ep.dml.disable_graph_fusion": _RUNTIME,
    "ep.dml.enable_graph_capture": _RUNTIME,
    "ep.dml.disable_memory_arena": _RUNTIME,
    # Once-per-process effects: refused in a pool's template.
    "session.save_external_prepacked_constant_initializers": _PER_PROCESS,
    "session.optimized_model_external_initializers_file_name": _PER_PROCESS,
    "session.optimized_model_external_initializers_min_size_in_bytes": _PER_PROCESS,
    "session.use_external_initializer_file_buffers_directly": _PER_PROCESS,  # the route's to set
}

COPIED_ATTRIBUTES = (
    "enable_cpu_mem_arena",
    "enable_mem_pattern",
    "enable_mem_reuse",
    "enable_profiling",
    "execution_mode",
    "execution_order",
    "graph_optimization_level",
    "inter_op_num_threads",
    "intra_op_num_threads",
    "log_severity_level",
    "log_verbosity_level",
    "logid",
    "profile_file_prefix",
    "use_deterministic_compute",
)


def config_entry(so: Any, key: str) -> str | None:
    """The value of config key ``key`` in ``so`` (a ``SessionOptions`` or None), or None."""
    if so is None:
        return None
    try:
        value = so.get_session_config_entry(key)
    except RuntimeError:  # ORT raises for a key that was never set
        return None
    return str(value)


def clone_session_options(template: Any | None) -> Any:
    """A new ``SessionOptions`` with ``template``'s public attributes and copied config keys.

    Raises:
        SharedMLError: the template sets a key that must not reach every session, writes an
            optimized model (``optimized_model_filepath``).
        ProviderError: the template has execution providers added (a ``SharedMLError`` too).
    """
    import onnxruntime as ort

    so = ort.SessionOptions()
    if template is None:
        return so
    has_providers = getattr(template, "has_providers", None)  # onnxruntime 1.23+
    if callable(has_providers) and has_providers():
        # ORT cannot read the devices back, so a copy would run on the CPU without a word.
        raise ProviderError(
            "sess_options has execution providers added (add_provider_for_devices or "
            "add_provider), which ORT cannot read back: every session of the pool would run on "
            "the CPU. Pass the provider to the pool instead: providers=[NAME] (or an "
            "OrtEpDevice), with ep_devices= to choose its device."
        )
    if getattr(template, "optimized_model_filepath", ""):
        raise SharedMLError(
            "sess_options sets optimized_model_filepath: every session of the pool would write "
            "that file. Save the optimized model with one plain InferenceSession instead."
        )
    for attr in COPIED_ATTRIBUTES:
        setattr(so, attr, getattr(template, attr))
    for key, policy in CONFIG_KEYS.items():
        value = config_entry(template, key)
        if value is None:
            continue
        if not policy.copied:
            raise SharedMLError(
                f"sess_options sets '{key}', which a pool cannot pass to every session (it "
                "makes each session write or map files the pool manages). Drop that entry."
            )
        so.add_session_config_entry(key, value)
    return so


def graph_settings(template: Any | None) -> tuple[int, dict[str, str]]:
    """The optimization level and the set config keys of ``template`` that change the graph.

    Returns:
        ``(level, {key: value})``; ORT's default level (ORT_ENABLE_ALL) for no template.
    """
    import onnxruntime as ort

    if template is None:
        return int(ort.GraphOptimizationLevel.ORT_ENABLE_ALL), {}
    carried = {
        key: value
        for key, policy in CONFIG_KEYS.items()
        if policy.changes_graph and (value := config_entry(template, key)) is not None
    }
    return int(template.graph_optimization_level), carried

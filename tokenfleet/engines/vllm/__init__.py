"""The vLLM backend: vLLM's V1 LLMEngine driven by the worker, behind the core's interface."""

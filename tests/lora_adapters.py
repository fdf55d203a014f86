"""LoRA adapters for the tests, made by ``peft`` itself with random weights (no hub): a base
model directory in, an adapter directory in PEFT's format out (beside conftest.py, so that any
suite can import it)."""

from __future__ import annotations

from pathlib import Path

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(
    base_dir: str, out: Path, rank: int, targets: list[str], seed: int, alpha: float | None = None
) -> str:
    """A PEFT LoRA adapter of ``base_dir`` with ``rank`` on ``targets``, both halves random (PEFT
    starts B at zero, which would change nothing), saved to ``out``."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha or 2 * rank,
        target_modules=targets,
        init_lora_weights=False,
        lora_dropout=0.0,
    )
    peft_model = get_peft_model(model, config)
    for name, param in peft_model.named_parameters():
        if "lora_B" in name:
            param.data.normal_(0.0, 0.05)
    peft_model.save_pretrained(str(out))
    return str(out)


class PeftReference:
    """Greedy continuations from ``PeftModel.from_pretrained(base, DIR).generate`` (or the base's),
    in float32, memoized: what an adapter's output must equal."""

    def __init__(self, base_dir: str):
        self.base_dir = base_dir
        self._models: dict[str | None, object] = {}
        self._memo: dict[tuple, list[int]] = {}

    def model(self, adapter_dir: str | None):
        if adapter_dir not in self._models:
            import torch
            from peft import PeftModel
            from transformers import AutoModelForCausalLM

            base = AutoModelForCausalLM.from_pretrained(self.base_dir, dtype=torch.float32)
            self._models[adapter_dir] = (
                PeftModel.from_pretrained(base, adapter_dir) if adapter_dir else base
            ).eval()
        return self._models[adapter_dir]

    def greedy(self, adapter_dir: str | None, ids: list[int], new_tokens: int) -> list[int]:
        key = (adapter_dir, tuple(ids), new_tokens)
        if key not in self._memo:
            import torch

            prompt = torch.tensor([ids])
            with torch.inference_mode():
                out = self.model(adapter_dir).generate(  # type: ignore[attr-defined]
                    input_ids=prompt,
                    attention_mask=torch.ones_like(prompt),
                    max_new_tokens=new_tokens,
                    min_new_tokens=new_tokens,
                    eos_token_id=None,
                    do_sample=False,
                )
            self._memo[key] = out[0, len(ids) :].tolist()
        return self._memo[key]

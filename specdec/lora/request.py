"""What a request names to run with an adapter (vLLM's vllm.lora.request.LoRARequest)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A LoRA adapter for a request: a Hugging Face PEFT folder (adapter_config.json and
    adapter_model.safetensors) under a name and a positive integer id, as in vLLM. Requests
    naming the same id share the adapter's loaded weights (and their cached prefix blocks)."""
    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self):
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must name the adapter's folder (or llama.cpp GGUF file), got {self.lora_path!r}")

    @property
    def adapter_id(self) -> int:         # vLLM's alias
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

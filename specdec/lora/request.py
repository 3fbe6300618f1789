"""What a request names to run with an adapter (vLLM's vllm.lora.request.LoRARequest)."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True, eq=False)
class LoRARequest:
    """A LoRA adapter for a request: a Hugging Face PEFT folder (adapter_config.json and
    adapter_model.safetensors) under a name and a positive integer id, as in vLLM. Requests
    naming the same id share the adapter's loaded weights (and their cached prefix blocks).
    load_inplace=True (vLLM's): the folder of an id already loaded is read again, and new
    requests get its weights if they changed (under this request's name and path); requests
    already running finish with the weights they started with. vLLM's other fields are taken
    (base_model_name: the model /v1/models lists as its parent; tensorizer_config_dict has no
    use here); two requests are equal when their names are, and hash by name, as vLLM's."""
    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None
    tensorizer_config_dict: dict | None = None
    load_inplace: bool = False

    def __eq__(self, other) -> bool:
        return isinstance(other, LoRARequest) and self.lora_name == other.lora_name

    def __hash__(self) -> int:
        return hash(self.lora_name)

    def __post_init__(self):
        if isinstance(self.lora_path, os.PathLike):
            object.__setattr__(self, "lora_path", os.fspath(self.lora_path))
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

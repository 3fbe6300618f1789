from .checkpoint import CheckpointError, load_model, save_model
from .config import ModelConfig
from .llama import KVCache, Transformer, TreeAttention

__all__ = ["CheckpointError", "KVCache", "ModelConfig", "Transformer", "TreeAttention", "load_model", "save_model"]

from .batch import ForwardBatch, ForwardOutput, TreeAttention
from .checkpoint import CheckpointError, load_model, save_model
from .config import ModelConfig
from .kv import BlockManager, KVCache
from .llama import Transformer

__all__ = ["BlockManager", "CheckpointError", "ForwardBatch", "ForwardOutput", "KVCache", "ModelConfig", "Transformer",
           "TreeAttention", "load_model", "save_model"]

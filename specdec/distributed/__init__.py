"""Tensor parallelism for the target: Megatron's split over torch.distributed ranks.

`LLM(..., tensor_parallel_size=N)` loads the target on N ranks (rank 0 is the calling process,
the others are spawned, or come from torchrun), shards it (shard.py), and drives every forward
from rank 0 (leader.py, worker.py). See README "Scale-out".
"""

from .launch import ParallelConfig, TargetSpec, start
from .leader import TensorParallelError

__all__ = ["ParallelConfig", "TargetSpec", "TensorParallelError", "start"]

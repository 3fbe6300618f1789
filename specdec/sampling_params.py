"""vLLM's module path for the sampling parameters: `from vllm.sampling_params import
SamplingParams, StructuredOutputsParams` ports by its module name alone (GuidedDecodingParams:
vLLM < 0.11's name of StructuredOutputsParams)."""

from .config import SamplingParams, StructuredOutputsParams

GuidedDecodingParams = StructuredOutputsParams

__all__ = ["SamplingParams", "StructuredOutputsParams", "GuidedDecodingParams"]

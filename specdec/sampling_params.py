"""vLLM's module path for the sampling parameters: `from vllm.sampling_params import
SamplingParams, StructuredOutputsParams, BeamSearchParams, RequestOutputKind` ports by its module
name alone (GuidedDecodingParams: vLLM < 0.11's name of StructuredOutputsParams; the outputs
themselves: specdec.outputs, vLLM's vllm.outputs)."""

from .beam_search import BeamSearchParams
from .config import RequestOutputKind, SamplingParams, StructuredOutputsParams

GuidedDecodingParams = StructuredOutputsParams

__all__ = ["SamplingParams", "StructuredOutputsParams", "GuidedDecodingParams", "BeamSearchParams",
           "RequestOutputKind"]

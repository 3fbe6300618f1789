"""vLLM's module path for the sampling parameters: `from vllm.sampling_params import
SamplingParams, StructuredOutputsParams, BeamSearchParams, RequestOutputKind` ports by its module
name alone (GuidedDecodingParams: vLLM < 0.11's name of StructuredOutputsParams; the outputs
themselves: specdec.outputs, vLLM's vllm.outputs)."""

from .beam_search import BeamSearchParams
from .config import RequestOutputKind, SamplingParams, StructuredOutputsParams



class GuidedDecodingParams:
    """vLLM < 0.11's name of StructuredOutputsParams, with its signature: its fields in its order,
    `backend` / `backend_was_auto` accepted (every backend name runs on llguidance), `json` also a
    pydantic model (its schema); builds the StructuredOutputsParams that means the same."""

    def __new__(cls, json=None, regex=None, choice=None, grammar=None, json_object=None, backend=None,
                backend_was_auto=False, disable_fallback=False, disable_any_whitespace=None,
                disable_additional_properties=False, whitespace_pattern=None, structural_tag=None):
        if backend is not None and not isinstance(backend, str):
            raise ValueError(f"guided_decoding.backend must be a backend's name, got {backend!r}")
        if hasattr(json, "model_json_schema"):
            json = json.model_json_schema()       # a pydantic model (class or instance), as vLLM takes it
        return StructuredOutputsParams(json=json, regex=regex, choice=choice, grammar=grammar, json_object=json_object,
                                       structural_tag=structural_tag, disable_any_whitespace=disable_any_whitespace,
                                       whitespace_pattern=whitespace_pattern,
                                       disable_additional_properties=disable_additional_properties,
                                       disable_fallback=disable_fallback)

    @staticmethod
    def from_optional(json=None, regex=None, choice=None, grammar=None, json_object=None, backend=None,
                      whitespace_pattern=None, structural_tag=None) -> StructuredOutputsParams | None:
        """vLLM's: None when no constraint is given, else the params."""
        if all(x is None for x in (json, regex, choice, grammar, json_object, structural_tag)):
            return None
        return GuidedDecodingParams(json=json, regex=regex, choice=choice, grammar=grammar, json_object=json_object,
                                    backend=backend, whitespace_pattern=whitespace_pattern,
                                    structural_tag=structural_tag)

__all__ = ["SamplingParams", "StructuredOutputsParams", "GuidedDecodingParams", "BeamSearchParams",
           "RequestOutputKind"]

"""trtllm_qwenvl: a TensorRT-LLM-style model pack and compact runtime for Qwen vision-language models."""
from .llmapi.llm import LLM
from .llmapi.outputs import CompletionOutput, RequestOutput
from .llmapi.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"

"""slipstream: a small, readable LLM inference and serving engine on PyTorch."""
from slipstream.llm import LLM
from slipstream.outputs import CompletionOutput, RequestOutput
from slipstream.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]

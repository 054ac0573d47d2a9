"""slipstream: a small, readable LLM inference and serving engine on PyTorch."""
import logging as _logging

from slipstream.llm import LLM
from slipstream.outputs import CompletionOutput, RequestOutput
from slipstream.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]

# Start-up facts (model, KV blocks) and the optional periodic stats line go to stderr, as in vLLM.
_logger = _logging.getLogger("slipstream")
if not _logger.handlers:
    _handler = _logging.StreamHandler()
    _handler.setFormatter(_logging.Formatter("%(levelname)s slipstream: %(message)s"))
    _logger.addHandler(_handler)
    _logger.setLevel(_logging.INFO)
    _logger.propagate = False

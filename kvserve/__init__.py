"""kvserve: an LLM inference serving engine (paged KV cache, continuous batching).

The engine classes are imported lazily, so that ``import kvserve.core...`` (the torch-free core) does
not pull in torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvserve.config import EngineConfig
    from kvserve.engine.async_llm import AsyncLLM
    from kvserve.engine.llm import LLM
    from kvserve.engine.llm_engine import LLMEngine
    from kvserve.outputs import CompletionOutput, RequestOutput

__version__ = "0.1.0"

__all__ = ["LLM", "AsyncLLM", "CompletionOutput", "EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams",
           "__version__"]

_LAZY = {
    "LLM": "kvserve.engine.llm",
    "AsyncLLM": "kvserve.engine.async_llm",
    "LLMEngine": "kvserve.engine.llm_engine",
    "EngineConfig": "kvserve.config",
    "CompletionOutput": "kvserve.outputs",
    "RequestOutput": "kvserve.outputs",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvserve' has no attribute {name!r}")

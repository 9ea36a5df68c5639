"""LLM: the offline batch API, ``LLM(model=...).generate(prompts, SamplingParams)``, as vLLM's."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from kvserve.config import EngineConfig
from kvserve.engine.llm_engine import LLMEngine, PromptType
from kvserve.errors import InvalidRequestError
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams


class LLM:
    """Generate for a batch of prompts with continuous batching.

    Args:
        model: catalog name, HF folder or ``.gguf`` path.
        **kwargs: any ``EngineConfig`` field (``max_num_seqs``, ``block_size``, ``dtype``, ...).

    Raises:
        ModelNotFoundError, InvalidRequestError: see ``LLMEngine``.
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        if model is not None:
            kwargs["model"] = model
        self.engine = LLMEngine(EngineConfig(**kwargs))

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """``SamplingParams()`` with the model's generation-config defaults (``generation_config``, as vLLM)."""
        return SamplingParams(**self.engine.default_sampling_params)

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the order of ``prompts``.

        Args:
            prompts: a string, a list of token ids, ``{"prompt_token_ids": [...]}`` or ``{"prompt": ...}``
                (either dict may carry ``"cache_salt"``: prefix-cache isolation, as vLLM), or a list of these.
            sampling_params: one for all prompts or one per prompt (default: ``get_default_sampling_params()``).

        Raises:
            InvalidRequestError: a bad prompt or parameter (nothing is left queued).
        """
        batch = _as_batch(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = [sampling_params] * len(batch) if isinstance(sampling_params, SamplingParams) else list(
            sampling_params)
        if len(params) != len(batch):
            raise InvalidRequestError(f"sampling_params: got {len(params)} for {len(batch)} prompts",
                                      param="sampling_params")
        ids: list[str] = []
        try:
            for p, sp in zip(batch, params, strict=True):
                salt = p.get("cache_salt") if isinstance(p, dict) else None
                ids.append(self.engine.add_request(None, p, sp, cache_salt=salt))
        except Exception:
            self.engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | None = None, use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, through the model's chat template."""
        if self.engine.tokenizer is None:
            raise InvalidRequestError("messages: chat needs a tokenizer", param="messages")
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts: list[PromptType] = [
            {"prompt_token_ids": self.engine.tokenizer.apply_chat_template(list(c))} for c in convs]  # type: ignore[arg-type]
        return self.generate(prompts, sampling_params, use_tqdm)

    def get_prefix_cache_stats(self) -> dict[str, float]:
        """Prefix-cache hit rate and counters since start (see ``LLMEngine.prefix_cache_stats``)."""
        return self.engine.prefix_cache_stats()

    def reset_prefix_cache(self) -> int:
        """Drop every cached block no request uses (e.g. between benchmark runs); returns how many."""
        return self.engine.reset_prefix_cache()

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        wanted = set(ids)
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm)
        try:
            while len(done) < len(ids):
                for out in self.engine.step():
                    if out.finished and out.request_id in wanted:
                        done[out.request_id] = out
                        bar.update(1)
        except BaseException:
            self.engine.abort_request([i for i in ids if i not in done])
            raise
        finally:
            bar.close()
        return [done[i] for i in ids]


def _as_batch(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, str | dict):
        return [prompts]
    if isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt of token ids
    return list(prompts)  # type: ignore[arg-type]

"""Default sampling parameters from a model's ``generation_config.json`` (vLLM's ``--generation-config``).

    --generation-config auto     the model folder's generation_config.json, when it has one (default, as vLLM)
    --generation-config vllm     no model defaults: SamplingParams' own (temperature 1, top_p 1, ...)
    --generation-config FOLDER   generation_config.json from FOLDER

A request that sets a field keeps its value; a field it leaves out takes the model's default. The keys read
are vLLM's: ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty`` and ``max_new_tokens``
(the default ``max_tokens``). A GGUF file carries no generation config, so ``auto`` gives no defaults for it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from kvserve.errors import InvalidRequestError
from kvserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# generation_config.json key -> SamplingParams field
_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
         "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def load_generation_defaults(source: str, model_path: Path) -> dict[str, Any]:
    """The SamplingParams defaults ``source`` gives (empty: none).

    Args:
        source: ``auto``, ``vllm`` or a folder holding ``generation_config.json``.
        model_path: the resolved model (an HF folder or a ``.gguf`` file).

    Raises:
        InvalidRequestError: ``source`` is a folder without a readable generation_config.json, or a value
            in the file is out of range (``param`` is ``generation_config``).
    """
    if source == "vllm":
        return {}
    if source == "auto":
        file = model_path / "generation_config.json" if model_path.is_dir() else None
        if file is None or not file.is_file():
            return {}
    else:
        file = Path(source) / "generation_config.json"
        if not file.is_file():
            raise InvalidRequestError(f"generation_config: {file} does not exist (give auto, vllm or a folder "
                                      "with a generation_config.json)", param="generation_config")
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise InvalidRequestError(f"generation_config: cannot read {file}: {e}", param="generation_config") from None
    if not isinstance(data, dict):
        raise InvalidRequestError(f"generation_config: {file} is not a JSON object", param="generation_config")
    defaults = {field: data[key] for key, field in _KEYS.items() if data.get(key) is not None}
    try:
        SamplingParams(**defaults)
    except InvalidRequestError as e:
        raise InvalidRequestError(f"generation_config: {file}: {e.message}", param="generation_config") from None
    if defaults:
        logger.info("default sampling parameters from %s (a request's own values win): %s", file, defaults)
    return defaults

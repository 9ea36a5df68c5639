"""N-gram prompt lookup (Saxena 2023, "Prompt Lookup Decoding"; vLLM's ``ngram`` method).

The last ``n`` tokens of a request (prompt + output so far) are searched for earlier in the same sequence,
longest ``n`` first (``prompt_lookup_max`` down to ``prompt_lookup_min``); the tokens that followed the
most recent earlier occurrence are the proposal. Editing tasks ("add type hints to this function") repeat
long runs of the prompt, so such proposals are often right, at no model cost. Torch-free (numpy).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    """Proposes up to ``k`` tokens by prompt lookup.

    Args:
        min_n / max_n: n-gram sizes tried, longest first (``1 <= min_n <= max_n``).
    """

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {min_n}, {max_n}")
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the most recent earlier occurrence of the longest matching suffix.

        Args:
            token_ids: the request's verified tokens (prompt + output), ``[L]``.
            k: the most tokens to propose (``k <= 0``: none).
        Returns:
            0..k token ids (fewer when the match sits near the end, none when no suffix of ``min_n`` or
            more tokens occurs earlier).
        """
        length = len(token_ids)
        if k <= 0 or length < self.min_n + 1:
            return []
        arr = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = arr[length - n:]
            # windows starting at 0 .. length-n-1: an occurrence strictly before the suffix itself, and
            # followed by at least one token.
            windows = sliding_window_view(arr[:length - 1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return arr[start:start + k].tolist()
        return []

"""model_runner._rows: the rows the LM head reads (a pure decode step skips the gather)."""

from __future__ import annotations

import numpy as np
import torch

from kvserve.worker.model_runner import _rows


def test_every_row_in_order_is_the_tensor_itself() -> None:
    hidden = torch.arange(12.0).view(4, 3)
    assert _rows(hidden, np.arange(4)) is hidden
    one = hidden[:1]
    assert _rows(one, np.array([0])) is one


def test_some_rows_are_gathered() -> None:
    hidden = torch.arange(12.0).view(4, 3)
    for idx in ([1, 3], [0, 1, 3], [3], [0, 2, 3]):
        out = _rows(hidden, np.array(idx))
        assert out is not hidden
        assert torch.equal(out, hidden[idx])
    assert _rows(hidden, np.array([], dtype=np.int64)).shape == (0, 3)

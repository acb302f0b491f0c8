"""The tile-skipping ranges agree with the element rule they summarize."""

import itertools

import numpy as np
import pytest

from cuflash.core.masking import (
    key_range,
    mean_visible_keys,
    normalize_window,
    query_range,
    visible_keys,
)


@pytest.mark.parametrize(
    "q_len, kv_len, window",
    list(
        itertools.product(
            (1, 7, 20), (0, 1, 9, 20), [(-1, -1), (0, 0), (3, -1), (2, 0), (-1, 4), (5, 2), (0, -1)]
        )
    ),
)
def test_ranges_cover_exactly_the_visible_keys(q_len, kv_len, window):
    mask = visible_keys(np.arange(q_len), np.arange(kv_len), q_len, kv_len, *window)
    for r0 in range(q_len):
        for r1 in range(r0 + 1, q_len + 1):
            lo, hi = key_range(r0, r1, q_len, kv_len, *window)
            cols = np.flatnonzero(mask[r0:r1].any(axis=0))
            if cols.size:
                assert lo <= cols.min() and cols.max() < hi
                assert mask[r0:r1, lo].any() and mask[r0:r1, hi - 1].any()  # tight
            else:
                assert lo >= hi or not mask[r0:r1, lo:hi].any()
    for c0 in range(kv_len):
        for c1 in range(c0 + 1, kv_len + 1):
            lo, hi = query_range(c0, c1, q_len, kv_len, *window)
            rows = np.flatnonzero(mask[:, c0:c1].any(axis=1))
            if rows.size:
                assert lo <= rows.min() and rows.max() < hi
            else:
                assert lo >= hi or not mask[lo:hi, c0:c1].any()


@pytest.mark.parametrize(
    "window, causal, expected",
    [
        (0, False, (-1, -1)),
        (0, True, (-1, 0)),
        (4, False, (3, -1)),
        (4, True, (3, 0)),
        ((2, 5), False, (2, 5)),
        ((2, 5), True, (2, 0)),
        ((-1, -1), True, (-1, 0)),
        (10**12, True, (-1, 0)),
    ],
)
def test_normalize_window(window, causal, expected):
    assert normalize_window(window, causal, 100, 100) == expected


@pytest.mark.parametrize(
    "q_len, kv_len, window",
    [(1, 1, (-1, -1)), (37, 37, (-1, 0)), (50, 20, (-1, 0)), (20, 50, (5, 3)), (64, 300, (-1, -1))],
)
def test_mean_visible_keys_counts_the_mask(q_len, kv_len, window):
    mask = visible_keys(np.arange(q_len), np.arange(kv_len), q_len, kv_len, *window)
    assert mean_visible_keys(q_len, kv_len, *window) == pytest.approx(mask.sum(1).mean())
    assert mean_visible_keys(0, kv_len, *window) == 0.0

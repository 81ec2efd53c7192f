"""Small helpers shared by the tests."""

import numpy as np

RTOL, ATOL = 1e-5, 1e-6


def padded(events: list, bound: int, shape: tuple[int, ...], dtype) -> np.ndarray:
    """`events` stacked on a new leading axis and padded to `bound` (NaN for floats, else 0)."""
    assert len(events) <= bound, f"{len(events)} events exceed the static bound {bound}"
    fill = np.nan if np.issubdtype(dtype, np.inexact) else 0
    out = np.full((bound, *shape), fill, dtype)
    for i, event in enumerate(events):
        out[i] = event
    return out


def assert_logs(logs, values: dict, counts: dict) -> None:
    """Check a LogDict against expected stacked values and counts (counts may broadcast)."""
    assert set(logs) == set(values), f"keys {sorted(logs)} != expected {sorted(values)}"
    for key, want in values.items():
        got = np.asarray(logs[key])
        assert got.shape == want.shape, f"{key!r}: shape {got.shape} != {want.shape}"
        assert got.dtype == want.dtype, f"{key!r}: dtype {got.dtype} != {want.dtype}"
        np.testing.assert_allclose(
            got, want, rtol=RTOL, atol=ATOL, equal_nan=True, err_msg=f"logs[{key!r}]"
        )
        want_count = np.asarray(counts[key])
        got_count = np.asarray(logs.count[key])
        np.testing.assert_array_equal(
            np.broadcast_to(got_count, want_count.shape), want_count, err_msg=f"count[{key!r}]"
        )


def assert_close(got, want, what: str = "output") -> None:
    np.testing.assert_allclose(
        np.asarray(got), np.asarray(want), rtol=RTOL, atol=ATOL, err_msg=what
    )


def assert_tree_allclose(got, want, *, rtol=RTOL, atol=ATOL, what: str = "output") -> None:
    """`got` matches `want` leaf by leaf (dicts recurse): same shape and dtype, close values,
    NaN where `want` has NaN; integer leaves exactly."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), f"{what}: keys {list(got)}"
        for k in want:
            assert_tree_allclose(got[k], want[k], rtol=rtol, atol=atol, what=f"{what}[{k!r}]")
        return
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    if np.issubdtype(want.dtype, np.inexact):
        np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, equal_nan=True, err_msg=what)
    else:
        np.testing.assert_array_equal(got, want, err_msg=what)

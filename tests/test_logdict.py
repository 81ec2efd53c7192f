"""A LogDict read by several threads at once: a `MultiLogger` hands one to each of its
loggers' writer threads, and a user's thread may read it beside them. An unflattened LogDict
unpacks its parts on first use; that happens once, whichever thread comes first."""

import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_logs

pytestmark = pytest.mark.fast


def _logs():
    def f(xs):
        def body(c, x):
            eqx_logs.log({"a": x, "b": 2 * x}, step=x.astype(jnp.int32))
            return c, None

        return jax.lax.scan(body, 0.0, xs)[0]

    return eqx_logs.spool(f)(jnp.arange(4.0))[1]


def test_a_logdict_is_unpacked_once_by_concurrent_readers():
    logs = _logs()
    leaves, treedef = jax.tree.flatten(logs)
    errors: list[BaseException] = []
    readers = 4
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch often: the race shows within a few hundred
    try:
        _race(treedef, leaves, readers, errors)
    finally:
        sys.setswitchinterval(switch)
    assert not errors, f"{len(errors)} failed reads, the first: {errors[0]!r}"
    # and a LogDict unpacked by a reader flattens back to the same leaves
    fresh = jax.tree.unflatten(treedef, leaves)
    fresh.count  # noqa: B018
    assert jax.tree.structure(fresh) == treedef
    assert all(x is y for x, y in zip(jax.tree.leaves(fresh), leaves))


def _race(treedef, leaves, readers, errors):
    want = np.arange(4)
    for _ in range(1500):
        fresh = jax.tree.unflatten(treedef, leaves)  # packed: nothing read yet
        barrier = threading.Barrier(readers)

        def read(fresh=fresh, barrier=barrier):
            barrier.wait()
            try:
                assert int(fresh.count["a"]) == 4
                np.testing.assert_array_equal(fresh.step["b"], want)
                assert sorted(fresh) == ["a", "b"]
            except BaseException as e:  # noqa: BLE001 (reported below)
                errors.append(e)

        threads = [threading.Thread(target=read) for _ in range(readers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

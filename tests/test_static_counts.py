"""Counts known at trace time are static (issue 37): `logs.count[key]` and `logs.rows[key]`
of straight-line and scanned logs are numpy int32 arrays in the LogDict's structure, not
outputs of a jitted spool, and read the same as before: equal to the counts by hand, the same
eagerly and jitted, and with the leading axes a `vmap`, `lax.map` or `lax.scan` around the
spool adds, as an output would have."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close
from jax import export, lax

import eqx_logs as el
from eqx_logs.loggers import JsonlLogger, read_jsonl
from eqx_logs.loggers._rows import _row_plan as _plan

pytestmark = pytest.mark.fast


def f(x):
    """Straight-line (2 events of `a`), scanned (3 of `s`), cond-chosen (`c`: 0 or 1) and
    while-looped (`w`: data-dependent) logs."""
    el.log({"a": x})
    el.log({"a": 2 * x, "b": x})

    def body(c, _):
        el.log({"s": c})
        return c + 1.0, None

    lax.scan(body, x, None, length=3)
    lax.cond(x > 1.0, lambda: el.log({"c": x}), lambda: None)

    def loop(c):
        el.log({"w": c}, reduce=el.Stack(capacity=8))
        return c + 1.0

    return lax.while_loop(lambda c: c < 4.0, loop, x)


def by_hand(x: float) -> dict[str, int]:
    return {"a": 2, "b": 1, "s": 3, "c": int(x > 1.0), "w": max(0, int(np.ceil(4.0 - x)))}


SPOOL = el.spool(f)


def _counts(logs) -> dict[str, np.ndarray]:
    return {k: np.asarray(logs.count[k]) for k in logs}


def test_known_counts_are_static_and_equal_to_the_counts_by_hand():
    for x in (0.5, 2.0):
        _, eager = SPOOL(jnp.float32(x))
        _, jitted = jax.jit(SPOOL)(jnp.float32(x))
        for logs in (eager, jitted):
            assert {k: int(c) for k, c in _counts(logs).items()} == by_hand(x)
            assert {k: int(r) for k, r in logs.rows.items()} == by_hand(x)
            for k in ("a", "b", "s"):  # known at trace time: numpy, in the structure
                assert type(logs.count[k]) is np.ndarray and logs.count[k].dtype == np.int32
                assert type(logs.rows[k]) is np.ndarray
            for k in ("c", "w"):  # decided on the device: outputs
                assert isinstance(logs.count[k], jax.Array)
        assert jax.tree.structure(eager) == jax.tree.structure(jitted)
        assert list(eager.count) == list(jitted.count) == list(eager)
        for got, want in zip(jax.tree.leaves(jitted), jax.tree.leaves(eager)):
            assert_close(got, want)


def test_a_jitted_spool_returns_no_output_for_a_known_count():
    """The compiled program's outputs: the function's, each key's value, and the counts and
    rows of `c` and `w` only; the same number as a `jax.jit` returning those by hand."""

    def outputs(fun, *args):
        return len(jax.tree.leaves(jax.jit(fun).trace(*args).out_info))

    x = jnp.float32(2.0)
    values = 5
    assert outputs(SPOOL, x) == 1 + values + 2 + 2

    def one(x):
        el.log("x", x)
        return x

    def one_by_hand(x):
        return x, x[None]

    assert outputs(el.spool(one), x) == outputs(one_by_hand, x) == 2


@pytest.mark.parametrize("around", ["vmap", "lax.map", "scan", "jit(vmap)"])
def test_known_counts_get_the_leading_axes_of_a_transformation_around_the_spool(around):
    xs = jnp.array([0.5, 2.0, 3.5], jnp.float32)
    if around == "vmap":
        _, logs = jax.vmap(SPOOL)(xs)
    elif around == "jit(vmap)":
        _, logs = jax.jit(jax.vmap(SPOOL))(xs)
    elif around == "lax.map":
        _, logs = lax.map(SPOOL, xs)
    else:
        _, logs = lax.scan(lambda c, x: (c, SPOOL(x)[1]), 0.0, xs)
    for key, want in {k: [by_hand(float(x))[k] for x in xs] for k in logs}.items():
        assert np.asarray(logs.count[key]).tolist() == want, key
        assert np.asarray(logs.rows[key]).tolist() == want, key
    # each lane, cut out of the batched LogDict, is the spool of its input: values, counts,
    # rows and the structure itself
    for i, x in enumerate(xs):
        lane = jax.tree.map(lambda v, i=i: v[i], logs)
        _, alone = SPOOL(x)
        assert jax.tree.structure(lane) == jax.tree.structure(alone)
        assert _counts(lane) == _counts(alone)
        for got, want in zip(jax.tree.leaves(lane), jax.tree.leaves(alone)):
            assert_close(got, want)


def test_a_changed_logdict_keeps_its_known_counts_through_flattening():
    _, logs = jax.vmap(SPOOL)(jnp.array([0.5, 2.0]))
    logs["a"] = logs["a"] + 1.0  # (unpacked, changed: flattened from its parts again)
    del logs["b"]
    leaves, treedef = jax.tree.flatten(logs)
    back = jax.tree.unflatten(treedef, leaves)
    assert np.asarray(back.count["a"]).tolist() == [2, 2]
    assert np.asarray(back.count["w"]).tolist() == [4, 2]
    assert "b" not in back and "b" not in back.count
    first = jax.tree.map(lambda v: v[0], back)
    assert int(first.count["a"]) == 2 and int(first.count["w"]) == 4


def test_exported_spool_keeps_its_known_counts():
    exported = export.deserialize(
        export.export(jax.jit(SPOOL))(jax.ShapeDtypeStruct((), jnp.float32)).serialize()
    )
    _, logs = exported.call(jnp.float32(2.0))
    assert {k: int(c) for k, c in _counts(logs).items()} == by_hand(2.0)
    assert type(logs.count["s"]) is np.ndarray
    _, want = SPOOL(jnp.float32(2.0))
    assert jax.tree.structure(logs) == jax.tree.structure(want)


def test_logger_jit_writes_the_rows_of_known_counts(tmp_path, monkeypatch):
    """`logger.jit`'s writes cut from its buffers (`RowPlan`) read a known count and rows
    from the structure: the same rows as the LogDicts written one by one."""
    from eqx_logs.loggers import _rows

    plans = []
    monkeypatch.setattr(_rows, "_row_plan", lambda layout: plans.append(_plan(layout)) or plans[-1])
    interval = 1

    def step(x, i):
        el.log({"a": x, "b": 2 * x}, step=i)

        def body(c, _):
            el.log({"s": c}, step=i)
            return c + 1.0, None

        return lax.scan(body, x, None, length=3)[0]

    paths = {}
    for form in ("jit", "write"):
        paths[form] = str(tmp_path / f"{form}.jsonl")
        with JsonlLogger(paths[form]) as logger:
            state = logger.init()
            if form == "jit":
                fn = logger.jit(step, state, interval=interval, step="i")
                for i in range(6):
                    fn(jnp.float32(i), i)
            else:
                for i in range(0, 6, interval):
                    _, logs = el.spool(step)(jnp.float32(i), i)
                    state = logger.write(logs, state)
    rows = {form: read_jsonl(p) for form, p in paths.items()}
    assert len(rows["jit"]) == 5 * 6
    # (the counts and rows known: 3 keys' counts, 3 keys' rows, in buffers of their own)
    assert [len(p.constants) for p in plans] == [6]
    strip = [{k: v for k, v in r.items() if k != "time"} for r in rows["jit"]]
    assert strip == [{k: v for k, v in r.items() if k != "time"} for r in rows["write"]]

"""Values sharded over a mesh (Explicit axes, as `jax.make_mesh` gives by default, and Auto
axes) stay sharded in every reduction state: spooling a scan that logs them works, and the
results equal the unsharded run. Four CPU devices, in a subprocess."""

import json
import subprocess
import sys
import textwrap

import pytest
from helpers import devices_env

SCRIPT = textwrap.dedent(
    """
    import json
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    import eqx_logs as el

    def f(x):
        def step(c, i):
            el.log("x", c * i, step=i.astype(jnp.int32))
            return c + 1, None
        return jax.lax.scan(step, x, jnp.arange(4.0))[0]

    x = jnp.arange(8.0)
    results = {}
    for kind in ("Explicit", "Auto"):
        mesh = jax.make_mesh((4,), ("d",), axis_types=(getattr(AxisType, kind),))
        with jax.set_mesh(mesh):
            xs = jax.device_put(x, NamedSharding(mesh, P("d")))
            for reduce in ("stack", "mean", "var", "last"):
                out, logs = jax.jit(el.spool(f, reduce=reduce, interval=2))(xs)
                _, want = el.spool(f, reduce=reduce, interval=2)(x)
                results[f"{kind}/{reduce}"] = {
                    "close": bool(np.allclose(logs["x"], want["x"], equal_nan=True)),
                    "spec": str(logs["x"].sharding.spec),
                    "count": int(logs.count["x"]),
                }
    print(json.dumps(results))
    """
)


@pytest.fixture(scope="module")
def results():
    env = devices_env(4)
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("reduce", ["stack", "mean", "var", "last"])
@pytest.mark.parametrize("kind", ["Explicit", "Auto"])
def test_sharded_values(results, kind, reduce):
    got = results[f"{kind}/{reduce}"]
    assert got["close"] and got["count"] == 2
    if kind == "Explicit":  # the state kept the value's sharding (after the event axis)
        assert got["spec"] == ("P(None, 'd')" if reduce == "stack" else "P('d',)")

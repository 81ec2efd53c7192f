"""One of the two processes of `test_quantiles.py`'s two-process test: a `shard_map` over the
4 devices of 2 processes (2 CPU devices each, gloo collectives over 127.0.0.1), each device
logging its own events into `Quantiles`, per device and merged `across="d"` (over both
processes, on the device). Writes `result<process>.json` into the output folder: the
gathered quantiles and sketch counts, and the events (for numpy in the test).

    python tests/quantiles_worker.py <process id> <port> <output folder>
"""

import json
import sys

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")
process, port, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
jax.distributed.initialize(
    f"127.0.0.1:{port}",
    num_processes=2,
    process_id=process,
    coordinator_bind_address=f"127.0.0.1:{port}",  # loopback only
    initialization_timeout=60,
)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import eqx_logs  # noqa: E402

QS = (0.0, 0.1, 0.5, 0.9, 0.99, 1.0)
mesh = jax.make_mesh((4,), ("d",))
red = eqx_logs.Quantiles(q=QS, sketch=True)


def local(x):  # one device: its (1, T, n) events
    def step(c, row):
        eqx_logs.log("x", row)
        return c, None

    return jax.lax.scan(step, jnp.zeros(1), x[0])[0]


sharded = jax.shard_map(local, mesh=mesh, in_specs=P("d"), out_specs=P("d"))
rng = np.random.default_rng(0)  # the same on both processes
xs_np = rng.choice([-1.0, 1.0], (4, 5, 64)) * 10.0 ** rng.uniform(-20, 20, (4, 5, 64))
xs_np = xs_np.astype(np.float32)
xs = jax.make_array_from_callback(
    xs_np.shape, NamedSharding(mesh, P("d")), lambda index: xs_np[index]
)


def gathered(x):
    return np.asarray(multihost_utils.process_allgather(x, tiled=True)).tolist()


_, per = jax.jit(eqx_logs.spool(sharded, reduce=red))(xs)
_, merged = jax.jit(eqx_logs.spool(sharded, reduce=red, across="d"))(xs)
result = {
    "per": {k: gathered(v) for k, v in per["x"].items() if k != "sketch"},
    "merged": {k: gathered(v) for k, v in merged["x"].items() if k != "sketch"},
    "per_counts": gathered(per["x"]["sketch"].counts),
    "merged_counts": gathered(merged["x"]["sketch"].counts),
    "xs": xs_np.tolist(),
}
multihost_utils.sync_global_devices("done")
with open(f"{out}/result{process}.json", "w") as f:
    json.dump(result, f)

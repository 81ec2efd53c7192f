"""One of the two processes of `test_per_example_distributed.py`: a `shard_map` over the 4
devices of 2 processes (2 CPU devices each, gloo collectives over 127.0.0.1), each device
logging its own events into `Quantiles`, `TopK` (with ids and steps) and `NoiseScale`, per
device and merged `across="d"` (over both processes, on the device). Writes
`result<process>.json` into the output folder: the gathered outputs, and the events (for
numpy in the test).

    python tests/per_example_worker.py <process id> <port> <output folder>
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


K, DECAY = 6, 0.8
top = eqx_logs.TopK(K)
noise = eqx_logs.NoiseScale(DECAY, lanes="mean")


def local(x, ids, terms):  # one device: its (1, T, n) events, ids, (1, T, 2) noise terms
    def step(c, t):
        eqx_logs.log("x", x[0, t])
        eqx_logs.log("top", x[0, t], ids=ids[0, t], reduce=top, step=t)
        small, big = terms[0, t, 0], terms[0, t, 1]
        event = {"small": small, "big": big, "b_small": 1, "b_big": 8}
        eqx_logs.log("noise", event, reduce=noise)
        return c, None

    return jax.lax.scan(step, jnp.zeros(1), jnp.arange(x.shape[1]))[0]


sharded = jax.shard_map(local, mesh=mesh, in_specs=P("d"), out_specs=P("d"))
rng = np.random.default_rng(0)  # the same on both processes
xs_np = rng.choice([-1.0, 1.0], (4, 5, 64)) * 10.0 ** rng.uniform(-20, 20, (4, 5, 64))
xs_np = xs_np.astype(np.float32)
ids_np = np.arange(xs_np.size, dtype=np.int32).reshape(xs_np.shape) + 1000
big_np = rng.uniform(0.5, 2.0, (4, 5)).astype(np.float32)
terms_np = np.stack([big_np + rng.uniform(1.0, 9.0, (4, 5)), big_np], -1).astype(np.float32)


def sharded_input(a):
    return jax.make_array_from_callback(a.shape, NamedSharding(mesh, P("d")), lambda i: a[i])


inputs = tuple(map(sharded_input, (xs_np, ids_np, terms_np)))


def gathered(x):
    return np.asarray(multihost_utils.process_allgather(x, tiled=True)).tolist()


_, per = jax.jit(eqx_logs.spool(sharded, reduce=red))(*inputs)
_, merged = jax.jit(eqx_logs.spool(sharded, reduce=red, across="d"))(*inputs)
result = {
    "per": {k: gathered(v) for k, v in per["x"].items() if k != "sketch"},
    "merged": {k: gathered(v) for k, v in merged["x"].items() if k != "sketch"},
    "per_counts": gathered(per["x"]["sketch"].counts),
    "merged_counts": gathered(merged["x"]["sketch"].counts),
    "top_per": {k: gathered(v) for k, v in per["top"].items()},
    "top_merged": {k: gathered(v) for k, v in merged["top"].items()},
    "noise_per": {k: gathered(v) for k, v in per["noise"].items()},
    "noise_merged": {k: gathered(v) for k, v in merged["noise"].items()},
    "xs": xs_np.tolist(),
    "ids": ids_np.tolist(),
    "terms": terms_np.tolist(),
}
multihost_utils.sync_global_devices("done")
with open(f"{out}/result{process}.json", "w") as f:
    json.dump(result, f)

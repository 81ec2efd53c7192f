"""One of the two processes of `test_distributed.py`: a data-parallel training scan, a
`shard_map` over the 4 devices of 2 processes (2 CPU devices each, gloo collectives over
127.0.0.1), spooled and written by loggers. Writes `result<process>.json` into the output
folder: the gathered spooled values and their numpy references.

    python tests/distributed_worker.py <process id> <port> <output folder>
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
from eqx_logs.loggers import JsonlLogger, TensorBoardLogger  # noqa: E402

STEPS, BATCH, DIM, LR = 3, 8, 3, 0.1
mesh = jax.make_mesh((4,), ("d",))


def local_step(w, x, y):  # one device's part of a step
    def loss_fn(w):
        return jnp.mean((x @ w - y) ** 2)

    # the device's own copy of the weights: its own gradient (of a replicated `w`, JAX's
    # gradient inside shard_map is already summed over the devices)
    loss, g = jax.value_and_grad(loss_fn)(jax.lax.pcast(w, ("d",), to="varying"))
    eqx_logs.log({"loss": loss, "grad_norm": jnp.linalg.norm(g)})
    return w - LR * jax.lax.pmean(g, "d")


def train(w, xs, ys):
    step = jax.shard_map(local_step, mesh=mesh, in_specs=(P(), P("d"), P("d")), out_specs=P())
    return jax.lax.scan(lambda w, b: (step(w, *b), None), w, (xs, ys))[0]


def numpy_reference(w, xs, ys):
    """Per step and device: loss and gradient norm; the final weights."""
    losses, norms = np.zeros((STEPS, 4)), np.zeros((STEPS, 4))
    for t in range(STEPS):
        grads = []
        for d in range(4):
            x, y = xs[t, 2 * d : 2 * d + 2], ys[t, 2 * d : 2 * d + 2]
            r = x @ w - y
            losses[t, d] = np.mean(r**2)
            g = 2 * x.T @ r / len(r)
            norms[t, d] = np.linalg.norm(g)
            grads.append(g)
        w = w - LR * np.mean(grads, 0)
    return losses, norms, w


rng = np.random.default_rng(0)
w0 = rng.normal(size=(DIM,)).astype(np.float32)
xs_np = rng.normal(size=(STEPS, BATCH, DIM)).astype(np.float32)
ys_np = rng.normal(size=(STEPS, BATCH)).astype(np.float32)


def global_array(x, spec):
    sharding = NamedSharding(mesh, spec)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


w = global_array(w0, P())
xs = global_array(xs_np, P(None, "d"))
ys = global_array(ys_np, P(None, "d"))


def gathered(x):
    return np.asarray(multihost_utils.process_allgather(x, tiled=True)).tolist()


w_out, logs = jax.jit(eqx_logs.spool(train))(w, xs, ys)
_, total = jax.jit(eqx_logs.spool(train, reduce="mean", across="d"))(w, xs, ys)
losses, norms, w_ref = numpy_reference(w0, xs_np, ys_np)
result = {
    "w": gathered(w_out),
    "loss": gathered(logs["loss"]),
    "grad_norm": gathered(logs["grad_norm"]),
    "count": gathered(logs.count["loss"]),
    "mean_loss": gathered(total["loss"]),
    "want_w": w_ref.tolist(),
    "want_loss": losses.tolist(),
    "want_grad_norm": norms.tolist(),
}

# loggers: spooled logs written once (by process 0), under jit and eagerly; tapped events
# inside the shard_map by each device's process; with every_process, by both
spool_logger = JsonlLogger(f"{out}/spool.jsonl")
jax.jit(spool_logger.spool(train, spool_logger.init(0), across="d", reduce="mean"))(w, xs, ys)
spool_logger.spool(train, spool_logger.init(1))(w, xs, ys)
spool_logger.jit(train, spool_logger.init(2))(w, xs, ys)  # the per-step loop's form
tap_logger = JsonlLogger(f"{out}/tap.jsonl")
jax.jit(tap_logger.tap(train, tap_logger.init()))(w, xs, ys)
every = JsonlLogger(f"{out}/every.jsonl", every_process=True)
jax.jit(every.spool(train, every.init()))(w, xs, ys)
board = TensorBoardLogger(f"{out}/tb")  # run_0 on process 0, run_0.process1 on process 1
jax.jit(board.tap(train, board.init()))(w, xs, ys)
for logger in (spool_logger, tap_logger, every, board):
    logger.close()
multihost_utils.sync_global_devices("written")

with open(f"{out}/result{process}.json", "w") as f:
    json.dump(result, f)

"""Data-parallel training over many devices and processes, with logging chosen by Hydra.

    python examples/distributed.py                         # 4 CPU devices in one process
    python examples/distributed.py logging.interval=1 train.steps=20
    python examples/distributed.py train.stream=true       # logger.tap: each device's events

    # two processes of 2 CPU devices each, joined by jax.distributed over 127.0.0.1:
    python examples/distributed.py train.processes=2 train.process=0 hydra.run.dir=outputs/p0 &
    python examples/distributed.py train.processes=2 train.process=1 hydra.run.dir=outputs/p1

Each step is a `jax.shard_map` over the devices: every device computes the loss and gradient
of its shard of the batch, the gradients are averaged with `pmean`. Two logs per step:

- `loss`, tagged "global": merged over the devices on the device (`across="d"`, mean), so the
  logger writes the loss of the whole batch, once per run (process 0 writes it);
- `grad_norm`, tagged "device": each device's own gradient norm, reduced as `logging=...`
  says and kept per device (a record holds one value per device).

The spools nest: the inner one (the Hydra policy, the "global" tag excluded) takes the
per-device keys; the events it does not select pass on to the outer one, which merges them
over the devices.
"""

import os
import sys
import tempfile
import time

# Before JAX starts: this many CPU devices per process (a GPU or TPU host has its own),
# unless XLA_FLAGS names a count; the other flags it holds are kept.
_processes = next((int(a.split("=")[1]) for a in sys.argv if a.startswith("train.processes=")), 1)
if "device_count" not in os.environ.get("XLA_FLAGS", ""):
    _count = f"--xla_force_host_platform_device_count={4 // max(_processes, 1)}"
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_count}".strip()

import equinox as eqx  # noqa: E402
import hydra  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from hydra.utils import instantiate  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

import eqx_logs  # noqa: E402
import eqx_logs.config  # noqa: E402, F401  (registers the structured configs)


def init(key: jax.Array, width: int) -> dict[str, jax.Array]:
    k1, k2 = jax.random.split(key)
    return {
        "w1": jax.random.normal(k1, (2, width)) / np.sqrt(2),
        "w2": jax.random.normal(k2, (width,)) / np.sqrt(width),
    }


def predict(params, x):
    return jnp.tanh(x @ params["w1"]) @ params["w2"]


def make_step(mesh, lr: float):
    def local_step(params, x, y, i):  # one device: its shard of the batch, at step i
        def loss_fn(params):
            return jnp.mean((predict(params, x) - y) ** 2)

        # the device's own copy of the weights, for its own gradient (the gradient of the
        # replicated weights would be summed over the devices already)
        own = jax.lax.pcast(params, ("d",), to="varying")
        loss, grads = jax.value_and_grad(loss_fn)(own)
        norm = jnp.sqrt(sum(jnp.sum(g**2) for g in jax.tree.leaves(grads)))
        eqx_logs.log({"loss": loss}, tags="global", step=i)
        eqx_logs.log({"grad_norm": norm}, tags="device", step=i)
        grads = jax.lax.pmean(grads, "d")
        return jax.tree.map(lambda p, g: p - lr * g, params, grads)

    specs = (P(), P("d"), P("d"), P())
    return jax.shard_map(local_step, mesh=mesh, in_specs=specs, out_specs=P())


def train_chunk(step, logger, state, policy, stream, params, xs, ys, start):
    """Steps `start, start + 1, ...` over the leading axis of `xs`, `ys`; the logger writes
    their logs."""
    steps = start + jnp.arange(xs.shape[0])

    def run(params):
        return jax.lax.scan(lambda p, b: (step(p, *b), None), params, (xs, ys, steps))[0]

    if stream:  # each selected event as it happens, from the device's own process
        return logger.tap(run, state, policy=policy)(params)
    per_device = logger.spool(run, state, policy=policy, exclude="global")
    return logger.spool(per_device, state, tags="global", across="d", reduce="mean")(params)


def connect(mesh) -> None:
    """Open the connections between the processes' devices now, with one collective over
    the mesh. Gloo, which carries the CPU collectives between processes, prints `[Gloo] Rank
    <r> is connected to <n> peer ranks...` for each device as it connects, from C++, straight
    to the process's standard output, with no setting to turn it off: those lines are kept
    out of the output; anything else printed meanwhile is passed on. Gloo prints from its own
    threads, possibly after the collective returns: the output stays caught until a whole
    line has come for each of this process's devices and no line is half written (or 10 s
    have passed)."""
    sys.stdout.flush()
    saved = os.dup(1)
    with tempfile.TemporaryFile("w+") as caught:
        os.dup2(caught.fileno(), 1)
        try:
            ones = jax.device_put(
                np.ones(jax.device_count(), np.float32), NamedSharding(mesh, P("d"))
            )
            jax.block_until_ready(jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))(ones))
            deadline = time.monotonic() + 10.0
            while not _gloo_done(caught) and time.monotonic() < deadline:
                time.sleep(0.01)
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        caught.seek(0)
        rest = [line for line in caught if not line.startswith("[Gloo] Rank ")]
    sys.stdout.write("".join(rest))


def _gloo_done(caught) -> bool:
    """Whether `caught` holds a whole `[Gloo] Rank ...` line for each of this process's
    devices, and no line half written (Gloo may write a line's text and its newline apart)."""
    caught.seek(0)
    text = caught.read()
    lines = text.splitlines(keepends=True)
    whole = sum(line.startswith("[Gloo] Rank ") and line.endswith("\n") for line in lines)
    return whole >= jax.local_device_count() and text.endswith("\n")


@hydra.main(config_path="conf", config_name="distributed", version_base="1.3")
def main(cfg: DictConfig) -> float:
    train = cfg.train
    if train.processes > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            train.coordinator,
            num_processes=train.processes,
            process_id=train.process,
            coordinator_bind_address=train.coordinator,  # not every interface
            initialization_timeout=120,
        )
    mesh = jax.make_mesh((jax.device_count(),), ("d",))
    if train.processes > 1:
        connect(mesh)
    policy = instantiate(cfg.logging)
    if train.steps % train.chunk or train.batch % jax.device_count():
        raise ValueError(
            f"train.steps={train.steps} must be a multiple of train.chunk={train.chunk}, and "
            f"train.batch={train.batch} of the device count {jax.device_count()}."
        )

    # the same data on every process, each device holding its shard of every batch
    rng = np.random.default_rng(train.seed)
    xs = rng.normal(size=(train.steps, train.batch, 2)).astype(np.float32)
    ys = (np.sin(2 * xs[..., 0]) * np.cos(xs[..., 1])).astype(np.float32)

    def shard(x):
        sharding = NamedSharding(mesh, P(None, "d"))
        return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

    def replicate(x):
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, NamedSharding(mesh, P()), lambda i: x[i])

    params = jax.tree.map(replicate, init(jax.random.key(train.seed), train.width))
    step = make_step(mesh, train.lr)
    chunk = eqx.filter_jit(train_chunk)
    with eqx_logs.config.instantiate_logger(cfg) as logger:  # cfg recorded with the run
        state = logger.init(train.run)
        for start in range(0, train.steps, train.chunk):
            part = slice(start, start + train.chunk)
            batches = shard(xs[part]), shard(ys[part])
            # `start` as an array: one compiled program for every chunk (see examples/train.py)
            params = chunk(
                step, logger, state, policy, train.stream, params, *batches, np.int32(start)
            )
    last = float(jnp.mean((jax.jit(predict)(params, xs[-1]) - ys[-1]) ** 2))
    where = os.path.join(HydraConfig.get().runtime.output_dir, getattr(logger, "path", ""))
    if jax.process_index() == 0:
        print(
            f"{jax.device_count()} devices in {jax.process_count()} process(es); "
            f"loss of the last batch {last:.4f} after {train.steps} steps"
        )
        print(f"written to {where}")
    return last


if __name__ == "__main__":
    main()

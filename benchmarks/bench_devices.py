"""Many devices: `spool` around a data-parallel `shard_map` step, and logging a batch-sharded
activation under a sharded `jit`, against the same programs returning their values by hand.

Four CPU devices (`XLA_FLAGS=--xla_force_host_platform_device_count=4`, set here unless the
environment sets it). Two measurements, each checked for equal values first:

- runtime of `jit(spool(shard_map(train)))` against the same scan of shard_map steps
  returning its metrics by hand (interleaved rounds, alternating which goes first, 3 calls
  each; median of per-round ratios);
  target 1.05. The global loss is merged over the devices with `across="d"` (a mean of
  every device's losses; by hand, each device's losses returned and averaged), the
  per-device gradient norms are kept per device.
- per-device memory (`compiled.memory_analysis()`: temporaries plus outputs) of a sharded
  `jit` that logs a batch-sharded activation at every step of a scan, against the scan
  returning it as `ys`; target 1.1.

Run from the repository root: `python benchmarks/bench_devices.py [--quick]`.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import argparse  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import eqx_logs  # noqa: E402

WIDTH, BATCH, STEPS, LR = 64, 256, 50, 0.05


def loss_fn(w, x, y):
    return jnp.mean((jnp.tanh(x @ w) - y) ** 2)


def make_train(mesh, log: bool, merge: bool = True):
    """`STEPS` SGD steps over device-local batches; by hand, the metrics as outputs."""

    def local_step(w, x, y):
        loss, g = jax.value_and_grad(loss_fn)(w, x, y)
        g = jax.lax.pmean(g, "d")
        norm = jnp.sqrt(jnp.sum(g**2))  # the same on every device (after the pmean)
        if log:
            eqx_logs.log({"loss": loss, "grad_norm": norm})
            return w - LR * g, None
        return w - LR * g, (loss[None], norm)  # each device's loss, as spool keeps it

    def train(w, xs, ys):
        def body(w, batch):
            return local_step(w, *batch)

        return jax.lax.scan(body, w, (xs, ys))

    out_specs = (P(), None) if log else (P(), (P(None, "d"), P()))
    sharded = jax.shard_map(
        train, mesh=mesh, in_specs=(P(), P(None, "d"), P(None, "d")), out_specs=out_specs
    )
    if log:
        return sharded

    def by_hand(w, xs, ys):  # as `across="d", reduce="mean"` gives: means of every device's
        w, (losses, norms) = sharded(w, xs, ys)
        return w, (jnp.mean(losses), jnp.mean(norms))

    return by_hand if merge else sharded


def timed(fn, *args) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start


def runtime(mesh, rounds: int) -> dict[str, float]:
    """spool / by hand: with each device's metrics stacked (the default), and with the loss
    merged over the devices (`across="d"`, a mean)."""
    key = jax.random.key(0)
    w = jax.random.normal(key, (WIDTH, WIDTH)) / WIDTH**0.5
    xs = jax.random.normal(jax.random.fold_in(key, 1), (STEPS, BATCH, WIDTH))
    ys = jnp.sin(xs)
    stacked = jax.jit(eqx_logs.spool(make_train(mesh, True)))
    merged = jax.jit(eqx_logs.spool(make_train(mesh, True), across="d", reduce="mean"))
    hand_stacked = jax.jit(make_train(mesh, False, merge=False))
    hand_merged = jax.jit(make_train(mesh, False))
    (w1, _), per_device = stacked(w, xs, ys)
    w2, (losses, norms) = hand_stacked(w, xs, ys)
    np.testing.assert_allclose(w1, w2, rtol=1e-5)
    np.testing.assert_allclose(per_device["loss"], losses, rtol=1e-5)
    np.testing.assert_allclose(per_device["grad_norm"][:, 0], norms, rtol=1e-5)
    _, logs = merged(w, xs, ys)
    _, (loss, mean_norm) = hand_merged(w, xs, ys)
    np.testing.assert_allclose(logs["loss"], loss, rtol=1e-5)
    np.testing.assert_allclose(logs["grad_norm"], mean_norm, rtol=1e-5)
    pairs = {"stacked per device": (stacked, hand_stacked), "across": (merged, hand_merged)}
    ratios: dict[str, list[float]] = {name: [] for name in pairs}
    for i in range(rounds):
        for name, (a, b) in pairs.items():
            # alternate which goes first; each time is the sum of 3 calls (one is ~15 ms)
            first, second = (a, b) if i % 2 == 0 else (b, a)
            t1 = sum(timed(first, w, xs, ys) for _ in range(3))
            t2 = sum(timed(second, w, xs, ys) for _ in range(3))
            ratios[name].append(t1 / t2 if i % 2 == 0 else t2 / t1)
    return {name: float(np.median(r)) for name, r in ratios.items()}


def memory(mesh) -> tuple[int, int]:
    """Per-device temporaries plus outputs, in bytes: spool, then by hand."""
    w = jnp.eye(WIDTH)
    x = jax.device_put(jnp.ones((BATCH, WIDTH)), NamedSharding(mesh, P("d")))

    def logged(w, x):
        def body(h, _):
            h = jnp.tanh(h @ w)
            eqx_logs.log({"h": h})
            return h, None

        return jax.lax.scan(body, x, None, length=STEPS)[0]

    def hand(w, x):
        def body(h, _):
            h = jnp.tanh(h @ w)
            return h, h

        return jax.lax.scan(body, x, None, length=STEPS)

    out = []
    for fn in (eqx_logs.spool(logged), hand):
        stats = jax.jit(fn).lower(w, x).compile().memory_analysis()
        out.append(stats.temp_size_in_bytes + stats.output_size_in_bytes)
    (_, logs), (_, hs) = jax.jit(eqx_logs.spool(logged))(w, x), jax.jit(hand)(w, x)
    np.testing.assert_allclose(logs["h"], hs, rtol=1e-6)
    assert "d" in str(logs["h"].sharding.spec), logs["h"].sharding
    return out[0], out[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    rounds = 5 if parser.parse_args().quick else 15
    devices = jax.devices()
    print(f"jax {jax.__version__}, {len(devices)} {devices[0].platform} devices")
    mesh = Mesh(np.array(devices), ("d",))
    for name, ratio in runtime(mesh, rounds).items():
        verdict = "OK" if ratio <= 1.05 else "MISS"
        print(
            f"jit(spool(shard_map(train))) / by hand, {name}, runtime: {ratio:.3f}x "
            f"(<= 1.05: {verdict})"
        )
    explicit = jax.make_mesh((len(devices),), ("d",), axis_types=(AxisType.Explicit,))
    for axes, m in (("Auto", mesh), ("Explicit", explicit)):
        spool_bytes, hand_bytes = memory(m)
        ratio = spool_bytes / hand_bytes
        verdict = "OK" if ratio <= 1.1 else "MISS"
        print(
            f"sharded jit ({axes} axes) logging an activation per step, per-device temp+output "
            f"memory: {spool_bytes / 2**20:.2f} MiB / {hand_bytes / 2**20:.2f} MiB = "
            f"{ratio:.3f}x (<= 1.1: {verdict})"
        )


if __name__ == "__main__":
    main()

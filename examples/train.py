"""The main example: train a small Equinox MLP, with logging chosen by Hydra configs.

    python examples/train.py                          # examples/conf/config.yaml defaults
    python examples/train.py logging.interval=100 logging.reduce=mean
    python examples/train.py logging.tags=train logger=console   # one tag, or '[train,eval]'
    python examples/train.py logging=debug
    python examples/train.py --multirun logging.interval=1,10

    python examples/train.py logger=tensorboard       # or wandb, mlflow, array, multi
    python examples/train.py logger=progress train.stream=true
    python -m eqx_logs plot outputs/<date>/<time>     # draws outputs/<date>/<time>/curves.png

    python examples/train.py instrument=all           # statistics of every layer (and gradient)
    python examples/train.py instrument=norms "instrument.where=['layers[0]']"
    python -m eqx_logs plot outputs/<date>/<time> -k 'layers[0]/*' -o outputs/layer0.png
    python examples/train.py logging.first_nonfinite=true train.lr=5   # where did it go NaN?

The training steps are scanned inside `eqx.filter_jit`. `logger.spool(run, state, policy=...)`
inside the jitted call collects the logs, reduced on the device as the policy says, and the
logger writes them into Hydra's run directory (on a background thread) after every chunk of
steps. With `train.stream=true`, `logger.tap` writes each selected event as it happens instead.
The logger is made by `eqx_logs.config.instantiate_logger(cfg)`, which records the whole
resolved config with the run (the JSONL file's first line, W&B's config, MLflow's params,
TensorBoard's hparams).

`instrument=all` (the package's group `instrument`) applies `eqx_logs.instrument` to the model
before training: every layer's output statistics are logged as `layers[<i>]/<stat>`, the
gradient's as `layers[<i>]/grad/<stat>` (tagged "instrument"; the step's
`eqx_logs.scope(step=...)` gives them the step, as it does the loss, so `logging.interval` keeps
them by step). With `logging.first_nonfinite=true` each chunk's logs are spooled here, then
written with `logger.write`, and the first value with a NaN or an infinity is reported (key,
step, pass, where it was logged).
"""

import logging
import os
import sys
from dataclasses import dataclass

import equinox as eqx
import hydra
import jax
import jax.numpy as jnp
import numpy as np
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.utils import instantiate, to_absolute_path
from omegaconf import MISSING, DictConfig

import eqx_logs
import eqx_logs.config  # noqa: F401  (registers the structured configs)
import eqx_logs.loggers


@dataclass
class TrainConfig:
    """The schema of the config's `train` block (its values are in conf/config.yaml): Hydra
    checks each override against these types when it composes the config, so that
    `train.lr=abc` is refused naming `train.lr`, before anything runs."""

    steps: int = MISSING  # training steps, scanned inside eqx.filter_jit
    chunk: int = MISSING  # steps per jitted call (logs are written after each)
    lr: float = MISSING
    width: int = MISSING
    batch: int = MISSING
    seed: int = MISSING
    run: int = MISSING  # the logger's run index
    stream: bool = MISSING  # logger.tap writes each event as it happens, instead of spooling


# conf/config.yaml's defaults list puts it under `train` (`- optional schema@train: train`)
ConfigStore.instance().store(group="schema", name="train", node=TrainConfig)

# The summary goes through Python's logging: Hydra writes it to the console and to the run's
# `train.log` (examples/conf/config.yaml: plain lines on the console).
log = logging.getLogger(__name__)


class MLP(eqx.Module):
    layers: tuple[eqx.nn.Linear, ...]

    def __init__(self, width: int, key: jax.Array):
        k1, k2, k3 = jax.random.split(key, 3)
        self.layers = (
            eqx.nn.Linear(2, width, key=k1),
            eqx.nn.Linear(width, width, key=k2),
            eqx.nn.Linear(width, 1, key=k3),
        )

    def __call__(self, x):
        for i, layer in enumerate(self.layers[:-1]):
            x = jax.nn.tanh(layer(x))
            eqx_logs.log({f"activation/{i}": jnp.mean(jnp.abs(x))}, tags="debug")
        return self.layers[-1](x)[0]


def loss_fn(model, x, y):
    # one example at a time, vmapped: `instrument`'s statistics are over the whole batch
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


@eqx.filter_jit
def train_chunk(model, logger, state, policy, stream, x, y, lr, start, num_steps):
    """`num_steps` SGD steps, scanned; the logger writes their logs. Returns the new model, and
    with `policy.first_nonfinite` the logs (for the caller to write), else None."""
    params, static = eqx.partition(model, eqx.is_array)  # an instrumented model's arrays

    def step(params, i):
        with eqx_logs.scope(step=start + i):  # every event of the step, instrument's too
            loss, grads = eqx.filter_value_and_grad(loss_fn)(eqx.combine(params, static), x, y)
            norms = {
                f"grad/layer{j}": jnp.sqrt(jnp.sum(layer.weight**2))
                for j, layer in enumerate(grads.layers)
            }
            eqx_logs.log({"loss": loss, **norms}, tags="train")
        params = jax.tree.map(lambda p, g: p - lr * g, params, eqx.filter(grads, eqx.is_array))
        return params, None

    def run(params):
        return jax.lax.scan(step, params, jnp.arange(num_steps))[0]

    logs = None
    if stream:  # each selected event as it happens (interval, tags, exclude; no reduction)
        params = logger.tap(run, state, policy=policy)(params)
    elif policy.first_nonfinite:  # the logs come out, with the report (logger.spool drops it)
        params, logs = eqx_logs.spool(run, policy=policy)(params)
    else:
        params = logger.spool(run, state, policy=policy)(params)
    return eqx.combine(params, static), logs


def dataset(key, batch):
    x = jax.random.normal(key, (batch, 2))
    return x, jnp.sin(2 * x[:, 0]) * jnp.cos(x[:, 1])


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> float:
    logging.getLogger("jax").setLevel(logging.WARNING)  # not JAX's search for a TPU
    policy = instantiate(cfg.logging)
    instrumentation = instantiate(cfg.instrument)  # `model -> model`, as configured
    train = cfg.train
    if train.steps % train.chunk:
        raise ValueError(
            f"train.steps={train.steps} must be a multiple of train.chunk={train.chunk}"
        )
    # Each jitted chunk is spooled on its own. The interval keeps the steps that are multiples
    # of it, whichever chunk they fall in (the step is logged); a window counts the events of
    # one chunk.
    if policy.window is not None and train.chunk % policy.window:
        raise ValueError(
            f"logging.window={policy.window} must divide train.chunk={train.chunk}: it counts "
            "events within each jitted chunk of steps."
        )
    if policy.first_nonfinite and train.stream:
        raise ValueError(
            "logging.first_nonfinite=true needs the logs spooled, not train.stream=true: a tap "
            "writes each event as it happens and does not look for non-finite values."
        )
    if train.stream and not (isinstance(policy.reduce, eqx_logs.Stack) and policy.window is None):
        raise ValueError(
            f"logging.reduce={type(policy.reduce).__name__.lower()} (window={policy.window}) "
            "needs the logs spooled, not train.stream=true: a tap writes each event as it "
            "happens and reduces none."
        )
    kdata, kmodel = jax.random.split(jax.random.key(train.seed))
    x, y = dataset(kdata, train.batch)
    # instrumented before training: the parameters are the instrumented model's arrays
    model = instrumentation(MLP(train.width, kmodel))
    first = float(loss_fn(model, x, y))
    nonfinite = None  # (the first chunk's start step, its report)
    with eqx_logs.config.instantiate_logger(cfg) as logger:  # cfg recorded with the run
        state = logger.init(train.run)
        for start in range(0, train.steps, train.chunk):
            # `start` as an array: traced, so that every chunk runs one compiled program (a
            # Python int would be static to `eqx.filter_jit`: a compilation per chunk)
            model, logs = train_chunk(
                model,
                logger,
                state,
                policy,
                train.stream,
                x,
                y,
                train.lr,
                np.int32(start),
                train.chunk,
            )
            if logs is not None:
                logger.write(logs, state)
                if nonfinite is None and logs.first_nonfinite is not None:
                    nonfinite = (start, logs.first_nonfinite)
    # leaving the `with` block waited for the writer thread and closed the files
    final = float(loss_fn(model, x, y))
    log.info(f"loss {first:.4f} -> {final:.4f} after {train.steps} steps")
    how = "tap" if train.stream else type(policy.reduce).__name__
    log.info(
        f"logged with {how}, interval={policy.interval}, window={policy.window}, "
        f"tags={policy.tags}, exclude={policy.exclude}"
    )
    log.info(f"instrumented: {instrumentation.describe()}")
    if policy.first_nonfinite:
        if nonfinite is None:
            log.info("first non-finite value: none, every logged value is finite")
        else:
            start, event = nonfinite
            # the keys logged with `step=` carry it; instrument's are placed by the scan's
            # iteration within the chunk
            step = event.steps.get("step", start + event.iterations[0])
            log.info(f"step {step}: {event}")
    out = HydraConfig.get().runtime.output_dir
    where = getattr(logger, "path", None) or getattr(logger, "logdir", None)
    if where is not None:
        log.info(f"written to {os.path.join(out, where)}")
        if isinstance(logger, eqx_logs.loggers.JsonlLogger):
            # after --multirun, the sweep's directory: a line per job in each panel
            hydra_cfg = HydraConfig.get()
            multirun = hydra_cfg.mode == RunMode.MULTIRUN
            runs = to_absolute_path(hydra_cfg.sweep.dir) if multirun else out
            image = os.path.join(runs, "curves.png")
            log.info(f"next: {sys.executable} -m eqx_logs plot {runs} -o {image}")
    elif isinstance(logger, eqx_logs.loggers.ConsoleLogger):
        log.info("written to the console")
    else:
        log.info(f"written by {type(logger).__name__} in {out}")
    return final


if __name__ == "__main__":
    main()

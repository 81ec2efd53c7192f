"""Every `!!! example` in the docstrings of the public API runs, as the README's and the
pages' examples do: each block in a fresh namespace, with the usual imports and the few
names the examples take as given (`CONTEXT`: an input `x`, a function `f` that logs, a
model and its loss, the loggers' training step and loop). An example that raises (a key that
is not logged, a name used but not defined here) fails with its owner's name. Every code block
of a public docstring fits the API pages' code column.

Each runs in a temporary directory of its own, where the loggers' examples write their files:
W&B offline, MLflow's database `mlflow.db` there, trackio in a temporary `TRACKIO_DIR`, no
Hugging Face credentials."""

import atexit
import contextlib
import inspect
import io
import os
import pathlib
import re
import shutil
import tempfile
import textwrap

import pytest
from test_docs import CODE_COLUMNS

import eqx_logs
import eqx_logs.config
import eqx_logs.loggers

pytestmark = pytest.mark.fast  # in `make test-fast`

if "TRACKIO_DIR" not in os.environ:  # read once, when trackio is imported (tests/test_trackio.py)
    os.environ["TRACKIO_DIR"] = tempfile.mkdtemp(prefix="eqx_logs-trackio-")
    atexit.register(shutil.rmtree, os.environ["TRACKIO_DIR"], ignore_errors=True)

MODULES = (eqx_logs, eqx_logs.loggers, eqx_logs.config)

IMPORTS = """\
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import eqx_logs
"""

# What the examples may take as given, and nothing more: an example that needs another name
# defines it itself.
CONTEXT = """\
x = jnp.array([0.5, -1.0])                      # an input (the MLP's: 2 features)
y = jnp.array([0.25])                           # a target
w = jnp.float32(0.3)                            # a weight


def f(x):                                       # a function that logs
    eqx_logs.log("loss", jnp.sum(x**2))
    return x


model = eqx.nn.MLP(2, 1, 8, 2, key=jax.random.key(0))


def loss_fn(model, x, y=y):
    return jnp.mean((model(x) - y) ** 2)


optimizer = optax.sgd(0.1)
opt_state = optimizer.init(eqx.filter(model, eqx.is_array))


# the loggers' training step and loop (AbstractLogger's example), which backends' examples run
def train_step(model, opt_state, x, y, step):
    loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
    eqx_logs.log({"loss": loss}, step=step)
    updates, opt_state = optimizer.update(grads, opt_state, model)
    return eqx.apply_updates(model, updates), opt_state


def train(logger, model, opt_state, steps=30):
    step = logger.jit(train_step, logger.init(), interval=10, step="step")
    for i in range(steps):
        model, opt_state = step(model, opt_state, x, y, i)
    return model, opt_state
"""


def _owners():
    """(qualified name, object) for each public name of `MODULES`, and for each class among
    them, its own methods and properties."""
    seen = set()
    for module in MODULES:
        for name, obj in sorted(vars(module).items()):
            if name.startswith("_") or not (inspect.isclass(obj) or inspect.isfunction(obj)):
                continue
            if not getattr(obj, "__module__", "").startswith("eqx_logs") or id(obj) in seen:
                continue
            seen.add(id(obj))
            yield f"{module.__name__}.{name}", obj
            if inspect.isclass(obj):
                for attr, member in sorted(vars(obj).items()):
                    member = getattr(member, "fget", member)  # a property's getter
                    member = getattr(member, "__func__", member)  # a static/class method
                    if attr.startswith("_") or not callable(member) or id(member) in seen:
                        continue
                    seen.add(id(member))
                    yield f"{module.__name__}.{name}.{attr}", member


def _examples(doc):
    """The ```python blocks inside each `!!! example` admonition of `doc`, dedented."""
    lines = inspect.cleandoc(doc).splitlines()
    blocks, k = [], 0
    while k < len(lines):
        line = lines[k]
        k += 1
        if not line.strip().startswith("!!! example"):
            continue
        indent = len(line) - len(line.lstrip())
        body = []
        while k < len(lines) and (
            not lines[k].strip() or len(lines[k]) - len(lines[k].lstrip()) > indent
        ):
            body.append(lines[k])
            k += 1
        text = textwrap.dedent("\n".join(body))
        blocks += re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)
    return blocks


def _cases():
    cases = []
    for name, obj in _owners():
        for n, code in enumerate(_examples(obj.__doc__ or "")):
            cases.append(pytest.param(name, code, id=f"{name}[{n}]"))
    return cases


CASES = _cases()


def test_every_example_is_collected():
    # every admonition in the package's source belongs to a public name (one block each),
    # so each is a case: none is left out by a name not walked here
    package = pathlib.Path(eqx_logs.__file__).parent
    admonitions = sum(p.read_text().count("!!! example") for p in package.rglob("*.py"))
    assert len(CASES) == admonitions >= 12, [c.id for c in CASES]
    owners = {c.values[0] for c in CASES}
    for name in ("eqx_logs.spool", "eqx_logs.tap", "eqx_logs.instrument", "eqx_logs.scope"):
        assert name in owners, sorted(owners)


@pytest.mark.parametrize("owner, code", CASES)
def test_docstring_example_runs(owner, code, wandb_env, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ["TRACKIO_SPACE_ID", "TRACKIO_SERVER_URL", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"]:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    namespace: dict = {"__name__": f"docstring_of_{owner.replace('.', '_')}"}
    exec(compile(IMPORTS + CONTEXT, "<docstring context>", "exec"), namespace)
    with contextlib.redirect_stdout(io.StringIO()):
        exec(compile(code, f"<example of {owner}>", "exec"), namespace)


def test_the_loggers_loop_is_abstract_loggers():
    # the backends' examples run `train` "as in AbstractLogger's example": CONTEXT's copy is
    # that example's, word for word
    (example,) = _examples(eqx_logs.loggers.AbstractLogger.__doc__)
    for name in ("train_step", "train"):
        definition = re.search(rf"^def {name}\(.*?(?=\n\n|\n\Z)", CONTEXT, flags=re.S | re.M)
        assert definition.group() in example, name
    assert "for i in range(steps):" in example


def _code_blocks(doc):
    """(columns, lines) for each fenced code block of `doc`: CODE_COLUMNS, the API pages' code
    column at 1280 px, less 2 for each admonition around the block (an `!!! example` box
    holds 80: its padding, measured in headless Chromium as test_docs.py's CODE_COLUMNS)."""
    lines = inspect.cleandoc(doc).splitlines()
    blocks, admonitions, k = [], [], 0
    while k < len(lines):
        line = lines[k]
        indent = len(line) - len(line.lstrip())
        if line.strip():
            admonitions = [a for a in admonitions if indent > a]
        if line.lstrip().startswith(("!!! ", "??? ", "???+ ")):
            admonitions.append(indent)
        elif line.lstrip().startswith("```"):
            body, k = [], k + 1
            while k < len(lines) and not lines[k].lstrip().startswith("```"):
                body.append(lines[k][indent:])
                k += 1
            blocks.append((CODE_COLUMNS - 2 * len(admonitions), body))
        k += 1
    return blocks


def test_docstring_code_fits_the_example_box():
    """No code line of a public name's docstring is wider than its box on the API page: a
    longer one scrolls sideways, or hides its end (the `# 16.0` of an example)."""
    wide, count = [], 0
    for name, obj in _owners():
        for columns, body in _code_blocks(obj.__doc__ or ""):
            count += 1
            wide += [f"{name} ({columns}): {line}" for line in body if len(line) > columns]
    assert count >= len(CASES), count
    assert not wide, "\n".join(wide)

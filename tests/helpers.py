"""Small helpers shared by the tests."""

import os
import re
import subprocess
import sys
import textwrap
from typing import Any

import numpy as np

RTOL, ATOL = 1e-5, 1e-6
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def without_device_count() -> str:
    """The XLA flags the suite runs under (`make test`'s, which its subprocesses keep), less
    any CPU device count."""
    return " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f)


def user_env() -> dict[str, str]:
    """This process's environment less `make test`'s LLVM -O0 (the Makefile's `TEST_XLA_FLAGS`),
    for a subprocess whose printed numbers must be what a user's default compile prints: -O0
    fuses no multiply-add, and a float's last bit can differ."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    kept = " ".join(f for f in flags if not f.startswith("--xla_backend_optimization_level"))
    return {**os.environ, "XLA_FLAGS": kept}


def at_default_level(f):
    """`jax.jit(f)`, compiled at XLA's default optimization level whatever `make test`'s
    `XLA_FLAGS` say (its LLVM -O0 rounds a float's last bit differently): for a test that
    compares two compiled programs bit for bit, as a user's default compile gives them."""
    import jax

    def call(*args):
        return jax.jit(f).lower(*args).compile({"xla_backend_optimization_level": 3})(*args)

    return call


def devices_env(n: int) -> dict[str, str]:
    """This process's environment for a subprocess with `n` CPU devices."""
    count = f"--xla_force_host_platform_device_count={n}"
    return {**os.environ, "XLA_FLAGS": f"{without_device_count()} {count}".strip()}


def run_two_processes(worker: str, out: Any, timeout: int = 300, **env: str) -> list[dict]:
    """Run `worker` as two processes joined by `jax.distributed` (`python worker <process id>
    <port> <out>`, a free loopback port, 2 CPU devices each), and return each process's
    `<out>/result<i>.json`; a process that fails or outlives `timeout` fails the test."""
    import json
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    environ = {**devices_env(2), **env}
    environ.pop("JAX_PLATFORMS", None)
    procs = [
        subprocess.Popen(
            [sys.executable, worker, str(i), port, str(out)],
            env=environ,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    texts = []
    try:
        for p in procs:
            texts.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, text in zip(procs, texts):
        assert p.returncode == 0, text[-4000:]
    return [json.loads(open(os.path.join(str(out), f"result{i}.json")).read()) for i in range(2)]


# A training loop as a script writes it (the loggers' docstring examples), once with each
# logger of `LOGGERS` (filled in); after each the script prints "done <i>" and nothing else of
# its own.
TRAINING_SCRIPT = """
import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import eqx_logs
from eqx_logs.loggers import *

x, y = jnp.array([0.5, -1.0]), jnp.array([0.25])


def train_step(model, opt_state, x, y, step):
    loss, grads = eqx.filter_value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
    eqx_logs.log({"loss": loss}, step=step)
    updates, opt_state = optimizer.update(grads, opt_state, model)
    return eqx.apply_updates(model, updates), opt_state


for n, make in enumerate(LOGGERS):
    model = eqx.nn.MLP(2, 1, 8, 2, key=jax.random.key(0))
    optimizer = optax.sgd(0.1)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_array))
    with make() as logger:
        step = logger.jit(train_step, logger.init(), interval=10)
        for i in range(30):
            model, opt_state = step(model, opt_state, x, y, jnp.int32(i))
    print("done", n)
"""


def run_training(loggers: list[str], cwd, env: dict[str, str] | None = None) -> tuple[str, str]:
    """`TRAINING_SCRIPT` with each of `loggers` (Python source) in turn, in one fresh Python on
    the CPU in `cwd`: (stdout, stderr), once it has exited 0. What a logger prints comes
    between the lines "done <i>" of the one before it and its own."""
    makers = ", ".join(f"lambda: {logger}" for logger in loggers)
    code = TRAINING_SCRIPT.replace("LOGGERS", f"[{makers}]")
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu", **(env or {})}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout, done.stderr


def padded(events: list, bound: int, shape: tuple[int, ...], dtype) -> np.ndarray:
    """`events` stacked on a new leading axis and padded to `bound` (NaN for floats, else 0)."""
    assert len(events) <= bound, f"{len(events)} events exceed the static bound {bound}"
    fill = np.nan if np.issubdtype(dtype, np.inexact) else 0
    out = np.full((bound, *shape), fill, dtype)
    for i, event in enumerate(events):
        out[i] = event
    return out


def assert_logs(logs, values: dict, counts: dict) -> None:
    """Check a LogDict against expected stacked values and counts (counts may broadcast)."""
    assert set(logs) == set(values), f"keys {sorted(logs)} != expected {sorted(values)}"
    for key, want in values.items():
        got = np.asarray(logs[key])
        assert got.shape == want.shape, f"{key!r}: shape {got.shape} != {want.shape}"
        assert got.dtype == want.dtype, f"{key!r}: dtype {got.dtype} != {want.dtype}"
        np.testing.assert_allclose(
            got, want, rtol=RTOL, atol=ATOL, equal_nan=True, err_msg=f"logs[{key!r}]"
        )
        want_count = np.asarray(counts[key])
        got_count = np.asarray(logs.count[key])
        np.testing.assert_array_equal(
            np.broadcast_to(got_count, want_count.shape), want_count, err_msg=f"count[{key!r}]"
        )


def assert_close(got, want, what: str = "output") -> None:
    np.testing.assert_allclose(
        np.asarray(got), np.asarray(want), rtol=RTOL, atol=ATOL, err_msg=what
    )


def assert_tree_allclose(got, want, *, rtol=RTOL, atol=ATOL, what: str = "output") -> None:
    """`got` matches `want` leaf by leaf (dicts recurse): same shape and dtype, close values,
    NaN where `want` has NaN; integer leaves exactly."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), f"{what}: keys {list(got)}"
        for k in want:
            assert_tree_allclose(got[k], want[k], rtol=rtol, atol=atol, what=f"{what}[{k!r}]")
        return
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    if np.issubdtype(want.dtype, np.inexact):
        np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, equal_nan=True, err_msg=what)
    else:
        np.testing.assert_array_equal(got, want, err_msg=what)


_CONSOLE_FIELD = re.compile(r"(?:^|  +)([^\s=]+)=")
_CONSOLE_NUMBER = re.compile(r"(-?[0-9]+)([.e].*)?")


def check_aligned(lines: list[str], prefix: str = "") -> list[dict[str, str]]:
    """ConsoleLogger output: every line is `<prefix>name=value  name=value ...` (the step
    names, then the keys), and where lines have the same names up to a field, that field's
    value has its decimal point (or the end of its integer part, or of a non-number) in one
    column. Returns each line's fields, `{name: value}` in order."""
    out, points = [], {}
    for line in lines:
        assert line.startswith(prefix), f"no {prefix!r}: {line!r}"
        body = line[len(prefix) :]
        assert body and body == body.rstrip() and not body.startswith(" "), repr(line)
        starts = list(_CONSOLE_FIELD.finditer(body))
        assert starts and starts[0].start() == 0, f"not `name=value ...`: {line!r}"
        fields, names = {}, ()
        for m, after in zip(starts, [*starts[1:], None]):
            raw = body[m.end() : after.start() if after else len(body)]
            value = raw.strip()
            assert value, f"empty value: {line!r}"
            assert m[1] not in fields, f"{m[1]!r} twice on a line: {line!r}"
            number = _CONSOLE_NUMBER.fullmatch(value)
            left = number[1] if number else value
            column = m.end() + (len(raw) - len(raw.lstrip())) + len(left)
            names = (*names, m[1])
            points.setdefault(names, set()).add(column)
            fields[m[1]] = value
        out.append(fields)
    for names, columns in points.items():
        assert len(columns) == 1, f"{names[-1]!r} not aligned after {names[:-1]}: {lines}"
    return out


# --- reading W&B's offline `.wandb` files (wandb has no Python reader for them) ------------

WANDB_BLOCK = 32 * 1024  # the LevelDB log format: 32 KiB blocks, counted from the file start
WANDB_HEADER = b":W&B" + (0xBEE1).to_bytes(2, "little") + bytes([0])
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def wandb_payloads(path, fragments: dict | None = None) -> list[bytes]:
    """The records of a `.wandb` file: a 7-byte header, then blocks of records, each
    `crc (4 bytes LE) | length (2 bytes LE) | type (1 byte) | payload`, a block tail under 7
    bytes being zero padding; records longer than a block's rest are split FIRST, MIDDLE...,
    LAST. Every checksum is verified (wandb uses zlib's CRC-32 of the type byte and payload).
    `fragments`, if given, counts the records of each type seen."""
    import zlib

    with open(path, "rb") as f:
        data = f.read()
    assert data[:7] == WANDB_HEADER, f"not a .wandb file: {data[:7]!r}"
    out: list[bytes] = []
    pending: bytes | None = None
    pos = 7
    while pos < len(data):
        left = WANDB_BLOCK - pos % WANDB_BLOCK
        if left < 7:  # padding to the next block
            assert data[pos : pos + left] == bytes(len(data[pos : pos + left])), pos
            pos += left
            continue
        assert pos + 7 <= len(data), f"truncated record header at {pos}"
        crc = int.from_bytes(data[pos : pos + 4], "little")
        length = int.from_bytes(data[pos + 4 : pos + 6], "little")
        kind = data[pos + 6]
        assert 7 + length <= left, f"record at {pos} crosses a block boundary"
        payload = data[pos + 7 : pos + 7 + length]
        assert len(payload) == length, f"truncated record at {pos}"
        assert zlib.crc32(bytes([kind]) + payload) == crc, f"bad checksum at {pos}"
        if fragments is not None:
            fragments[kind] = fragments.get(kind, 0) + 1
        if kind == FULL:
            assert pending is None, f"FULL record inside a fragmented one at {pos}"
            out.append(payload)
        elif kind == FIRST:
            assert pending is None, f"FIRST record inside a fragmented one at {pos}"
            pending = payload
        elif kind in (MIDDLE, LAST):
            assert pending is not None, f"{kind=} without FIRST at {pos}"
            pending += payload
            if kind == LAST:
                out.append(pending)
                pending = None
        else:
            raise AssertionError(f"unknown record type {kind} at {pos}")
        pos += 7 + length
    assert pending is None, "file ends inside a fragmented record"
    return out


def read_wandb(path, fragments: dict | None = None, timeout: float = 20.0) -> dict:
    """One offline W&B run: `{"name", "group", "config": {key: value}, "history": [row]}`,
    each history row a dict from the logged name (nested keys joined by "/") to its decoded
    JSON value, `_step` included. W&B writes the file from its own process: this waits (up to
    `timeout` seconds) until the file is complete, ending with the run's exit record."""
    import json
    import time

    from wandb.proto import wandb_internal_pb2

    deadline = time.monotonic() + timeout
    while True:
        counts: dict = {}
        try:
            payloads = wandb_payloads(path, counts)
            records = []
            for payload in payloads:
                record = wandb_internal_pb2.Record()
                record.ParseFromString(payload)
                records.append(record)
            assert records and records[-1].WhichOneof("record_type") == "exit", "no exit record"
            break
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    if fragments is not None:
        fragments.update(counts)
    run: dict = {"name": None, "group": None, "config": {}, "history": []}
    for record in records:
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run["name"] = record.run.display_name
            run["group"] = record.run.run_group
            for item in record.run.config.update:
                name = item.key or "/".join(item.nested_key)
                run["config"][name] = json.loads(item.value_json)
        elif kind == "history":
            row = {}
            for item in record.history.item:
                row[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
            run["history"].append(row)
    return run


def write_leveldb_log(payloads: list[bytes]) -> bytes:
    """The inverse of `wandb_payloads` (for testing the reader on chosen boundaries)."""
    import zlib

    out = bytearray(WANDB_HEADER)
    for payload in payloads:
        first = True
        while True:
            left = WANDB_BLOCK - len(out) % WANDB_BLOCK
            if left < 7:
                out += bytes(left)
                continue
            n = min(len(payload), left - 7)
            part, payload = payload[:n], payload[n:]
            kind = (FULL if not payload else FIRST) if first else (LAST if not payload else MIDDLE)
            out += zlib.crc32(bytes([kind]) + part).to_bytes(4, "little")
            out += n.to_bytes(2, "little") + bytes([kind]) + part
            first = False
            if not payload:
                break
    return bytes(out)


def read_tensorboard(rundir) -> tuple[dict, dict]:
    """`(scalars, histograms)` of one TensorBoard run directory, read with tensorboard's own
    EventAccumulator: tag -> [(step, value)], and tag -> [(step, (min, max, num, sum,
    sum_squares))]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(os.fspath(rundir), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    tags = acc.Tags()
    scalars = {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in tags["scalars"]}
    histograms = {}
    for t in tags["histograms"]:
        histograms[t] = []
        for e in acc.Histograms(t):
            h = e.histogram_value
            assert sum(h.bucket) == h.num, f"{t}: bucket counts do not add up"
            histograms[t].append((e.step, (h.min, h.max, h.num, h.sum, h.sum_squares)))
    return scalars, histograms


def one_edit_away(name: str, alphabet: str) -> set[str]:
    """Every string one typo from `name`, enumerated (a reference for the likely-typo rule):
    a character of `alphabet` inserted or put in place of one, a character deleted, or two
    swapped that are side by side or have one between them."""
    out = {name}
    for i in range(len(name) + 1):
        out |= {name[:i] + c + name[i:] for c in alphabet}
    for i in range(len(name)):
        out.add(name[:i] + name[i + 1 :])
        out |= {name[:i] + c + name[i + 1 :] for c in alphabet}
        for j in (i + 1, i + 2):
            if j < len(name):
                chars = list(name)
                chars[i], chars[j] = chars[j], chars[i]
                out.add("".join(chars))
    return out

"""TrackioLogger, end to end, as tests/test_backends.py checks the other backends: events
written through `logger.spool` and `logger.tap` (inside `jax.jit`, a `lax.scan` over epochs,
`jax.vmap` over logger states) are read back with trackio's own reader (`trackio.Api` for the
runs and their config, `SQLiteStorage.get_logs` for each run's history, as trackio's
dashboard reads it) and compared with the numpy reference of tests/test_backends.py.

trackio reads its directory (TRACKIO_DIR) once, when first imported: this module points it
at a temporary directory when it is collected, before any test imports trackio. Every test
runs with the network closed (a connection or a listening socket fails the test) and without
Hugging Face credentials or trackio's Space/server variables."""

import atexit
import os
import shutil
import socket
import tempfile
from collections import defaultdict
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import run_training
from jax import lax
from test_backends import (
    EPOCHS,
    MODES,
    RUNS,
    T,
    bf16_program,
    close,
    compare_series,
    drive,
    finite_of,
    reference_series,
    stepped_and_stepless,
    want_events,
)

import eqx_logs
from eqx_logs.loggers import TrackioLogger, WriterError

TRACKIO_DIR = tempfile.mkdtemp(prefix="eqx_logs-trackio-")
os.environ["TRACKIO_DIR"] = TRACKIO_DIR  # before anything imports trackio
atexit.register(shutil.rmtree, TRACKIO_DIR, ignore_errors=True)
pytest.importorskip("trackio")


@pytest.fixture(autouse=True)
def offline_trackio(monkeypatch, tmp_path, request):
    """No credentials, no Space or server, and no network: every attempt to connect or to
    listen on an internet socket is recorded, fails, and fails the test."""
    import huggingface_hub.constants
    import trackio.utils

    here = Path(trackio.utils.TRACKIO_DIR).resolve()
    assert here == Path(TRACKIO_DIR).resolve(), f"trackio was imported earlier, writing to {here}"
    for name in ["TRACKIO_SPACE_ID", "TRACKIO_SERVER_URL", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"]:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    attempts = []

    def guard(method):
        original = getattr(socket.socket, method)

        def guarded(self, address, *args):
            if self.family in (socket.AF_INET, socket.AF_INET6):
                attempts.append((method, address))
                raise OSError(f"test_trackio: no network ({method} {address})")
            return original(self, address, *args)

        monkeypatch.setattr(socket.socket, method, guarded)

    for method in ["connect", "connect_ex", "bind"]:
        guard(method)
    yield
    assert not attempts, f"trackio tried the network: {attempts}"


@pytest.fixture
def project(request) -> str:
    """A project of its own for each test (they share trackio's directory)."""
    return "eqx_logs-" + "".join(c if c.isalnum() else "_" for c in request.node.name)


def read_trackio(project: str) -> dict[str, dict]:
    """run name -> {"config", "series": tag -> [(step, value)]}, read with trackio's API:
    numbers as they are, histograms as (counts, bin edges)."""
    import trackio
    from trackio.sqlite_storage import SQLiteStorage

    out = {}
    for run in trackio.Api().runs(project):
        series = defaultdict(list)
        for row in SQLiteStorage.get_logs(project, run.name, run_id=run.id):
            for tag, value in row.items():
                if tag in ("step", "timestamp"):
                    continue
                if isinstance(value, dict):
                    assert value["_type"] == "trackio.histogram", value
                    value = (value["values"], value["bins"])
                series[tag].append((row["step"], value))
        assert run.name not in out, f"two runs named {run.name}"
        out[run.name] = {"config": run.config, "series": dict(series)}
    return out


def trackio_reference(events) -> dict:
    """Scalars as they are; arrays as the histogram of their finite entries (64 bins), an
    empty one when none is finite."""
    out = {}
    for tag, series in reference_series(events).items():
        out[tag] = []
        for s, leaf in series:
            if leaf.size == 1:
                out[tag].append((s, leaf))
                continue
            finite = finite_of(leaf)
            hist = np.histogram(finite, bins=64) if finite.size else ([], [])
            out[tag].append((s, hist))
    return out


def trackio_compare(got, want, what) -> None:
    if isinstance(want, tuple):
        np.testing.assert_array_equal(got[0], want[0], err_msg=f"{what} counts")
        np.testing.assert_allclose(got[1], want[1], rtol=1e-9, err_msg=f"{what} bins")
    elif np.asarray(want).dtype == np.int32:
        assert type(got) is int and got == int(want), f"{what}: {got!r} != {want!r}"
    else:
        assert type(got) is float, f"{what}: {got!r}"
        close(got, want, what)


def test_trackio_prints_nothing(tmp_path):
    """A script's training loop with a TrackioLogger prints its own line alone: not trackio's
    (where it writes, how to start its dashboard, "Uploading logs to Trackio (please
    wait...)" though nothing is uploaded), nothing on stderr; the run is written."""
    env = {"TRACKIO_DIR": str(tmp_path / "trackio"), "HF_HUB_OFFLINE": "1"}
    logger = 'TrackioLogger(project="demo", config={"lr": 0.1})'
    assert run_training([logger], tmp_path, env) == ("done 0\n", "")
    assert [p.name for p in (tmp_path / "trackio").glob("*.db")] == ["demo.db"]


@pytest.mark.parametrize("mode", MODES)
def test_trackio(project, mode):
    config = {"lr": 0.5, "layers": [2, 3], "mode": mode}
    with TrackioLogger(project=project, name="grp", config=config) as logger:
        drive(logger, mode)
    runs = read_trackio(project)
    assert sorted(runs) == [f"grp-{r}" for r in range(RUNS)]
    for run in range(RUNS):
        got = runs[f"grp-{run}"]
        assert {k: v for k, v in got["config"].items() if not k.startswith("_")} == config
        assert got["config"]["_Group"] == "grp"
        want = trackio_reference(want_events(run, mode))
        assert "dead" in want and ([], []) in [v for _, v in want["dead"]]  # preconditions
        assert {s for s, _ in want["loss"]} == set(range(EPOCHS * T))
        compare_series(got["series"], want, f"run {run}", trackio_compare)


def test_trackio_stepless_events_at_trackio_next_step(project):
    """Spooled, a write's stepped events come first, at their steps; each stepless one then
    gets trackio's next step. Tapped, each event is its own write."""
    xs = np.arange(1.0, 5.0, dtype=np.float32)

    def only_stepless(xs):
        def body(c, x):
            eqx_logs.log("lr", 10 * x)
            return c, None

        return lax.scan(body, 0.0, xs)[0]

    with TrackioLogger(project=project) as logger:
        logger.spool(stepped_and_stepless, logger.init(0))(xs)
        logger.tap(only_stepless, logger.init(1))(xs)
    runs = read_trackio(project)
    assert runs["eqx_logs-0"]["series"] == {
        "loss": [(i, float(x)) for i, x in enumerate(xs)],
        "lr": [(4 + i, 10.0 * float(x)) for i, x in enumerate(xs)],
    }
    assert runs["eqx_logs-1"]["series"] == {"lr": [(i, 10.0 * float(x)) for i, x in enumerate(xs)]}


def test_trackio_reopened_logger_resumes_its_runs(project):
    """Closed and used again, a logger appends to its own runs (stepless events continue from
    the last step); a new logger with the same names starts new runs."""

    def f(x):
        eqx_logs.log("a", x)

    logger = TrackioLogger(project=project)
    for x in [1.0, 2.0]:
        with logger:
            logger.spool(f, logger.init())(jnp.float32(x))
    (run,) = read_trackio(project).values()
    assert run["series"] == {"a": [(0, 1.0), (1, 2.0)]}

    with TrackioLogger(project=project) as other:
        other.spool(f, other.init())(jnp.float32(3.0))
    import trackio

    runs = list(trackio.Api().runs(project))
    assert [r.name for r in runs] == ["eqx_logs-0", "eqx_logs-0"] and runs[0].id != runs[1].id


def test_trackio_bfloat16_and_jitted_spool(project):
    import equinox as eqx

    with TrackioLogger(project=project) as logger:
        eqx.filter_jit(logger.spool(bf16_program, logger.init()))(jnp.float32(1.5))
    (run,) = read_trackio(project).values()
    assert run["series"]["s"] == [(0, 1.5)]
    counts, bins = run["series"]["v"][0][1]
    assert sum(counts) == 1 and bins[0] <= 1.5 <= bins[-1]


def test_trackio_rejects_complex_by_key(project):
    with TrackioLogger(project=project) as logger:
        logs = eqx_logs.LogDict(
            {"z": np.complex64(1 + 2j), "x": np.float32(3.0)}, count={"z": 1, "x": 1}
        )
        with pytest.raises(ValueError, match="TrackioLogger cannot store key 'z': complex"):
            logger.write(logs)
    (run,) = read_trackio(project).values()
    assert run["series"] == {"x": [(0, 3.0)]}


def test_trackio_bad_settings_fail_when_the_logger_is_made(tmp_path):
    with pytest.raises(ValueError, match=r"config keys \['_x'\] start with '_'"):
        TrackioLogger(config={"_x": 1})
    with pytest.raises(ValueError, match="trackio was already imported"):
        TrackioLogger(dir=os.fspath(tmp_path))
    assert TrackioLogger(dir=TRACKIO_DIR).dir == TRACKIO_DIR  # the directory in use is fine
    assert not list(tmp_path.iterdir())


@pytest.mark.filterwarnings("ignore:TrackioLogger.*not written")  # the writer's count of it
def test_trackio_backend_error_surfaces(project):
    """An error of trackio itself (here a reserved project name) is raised by the next call.

    trackio's run opens on the writer thread, so the error reaches whichever call comes
    after it: the write when the thread is quick, else the close.
    """
    logger = TrackioLogger(project="registry-" + project)
    with pytest.raises(WriterError, match="reserved"):
        logger.write(eqx_logs.LogDict({"x": np.float32(1.0)}, count={"x": 1}))
        logger.close()
    logger.close()  # the error was reported once; closing again is quiet

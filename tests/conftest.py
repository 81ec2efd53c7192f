"""The whole suite runs as Equinox's own does, and as many of its users do: with strict dtype
promotion (`jax_numpy_dtype_promotion="strict"`: no implicit promotion between different
dtypes, Python scalars aside) and rank promotion raising (`jax_numpy_rank_promotion="raise"`:
no implicit broadcasting between different ranks). Library code must cast explicitly.

The environment variables carry the same settings into the subprocesses that tests start
(examples, Hydra runs, multi-device and multi-process checks): JAX reads them at import.

The tests' own processes (the run's and pytest-xdist's workers) share one JAX compilation
cache, in a folder made for the run and removed after it: a program two tests (or two workers)
compile alike is compiled once. Measured side by side, it takes 0.93x the CPU time of the
diffrax, optimistix and lineax tests. Every process of the run keeps its compiled Python
there too.
"""

import atexit
import gc
import os
import shutil
import tempfile
from pathlib import Path

os.environ["JAX_NUMPY_DTYPE_PROMOTION"] = "strict"
os.environ["JAX_NUMPY_RANK_PROMOTION"] = "raise"

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")

# Python's cycle collector less often: tracing and compiling make millions of objects, and
# each full collection walks JAX's caches. Measured on tests/test_reductions.py and
# test_masking.py (one process): 1.0 s collecting instead of 3.4 s, of 80 s; the same peak
# memory (the cycles are still collected, in fewer passes).
gc.set_threshold(20_000, 20, 20)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # (another user's)
        return True
    return True


def _run_folder() -> Path:
    """A folder for the run, removed when the run ends; the folders of runs that were killed
    (no exit handler ran) are removed when the next run starts."""
    root = Path(tempfile.gettempdir())
    for old in [*root.glob("eqx_logs-tests-*"), *root.glob("eqx_logs-jax-cache-*")]:
        pid = old.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _running(int(pid)):
            shutil.rmtree(old, ignore_errors=True)
    folder = root / f"eqx_logs-tests-{os.getpid()}"
    shutil.rmtree(folder, ignore_errors=True)  # (a process of the same number, long gone)
    folder.mkdir()
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


if "EQX_LOGS_TEST_JAX_CACHE" not in os.environ:  # the run's first process (workers inherit it)
    _folder = _run_folder()
    (_folder / "jax").mkdir()
    os.environ["EQX_LOGS_TEST_JAX_CACHE"] = str(_folder / "jax")
    # The workers and every Python the tests start keep the modules they compile (the
    # package's, the tests' with their asserts rewritten) in the run's folder, not in the
    # checkout, even where PYTHONDONTWRITEBYTECODE is set: the ~80 subprocesses that import
    # eqx_logs compile it once, not each (0.3 s of each one's start).
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    os.environ["PYTHONPYCACHEPREFIX"] = str(_folder / "pyc")
jax.config.update("jax_compilation_cache_dir", os.environ["EQX_LOGS_TEST_JAX_CACHE"])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


@pytest.fixture(scope="module")
def jax_cache(tmp_path_factory) -> dict[str, str]:
    """The environment of a JAX persistent compilation cache shared by one module's
    subprocesses (example runs, Hydra runs, the docs pages' interpreters), empty at the start
    of the module, for every program however quick to compile: runs that compile the same
    small programs (a model's initialisation, the data, an eager loss) compile them once.
    Programs with host callbacks (a spool's, a logger's) are never cached: each run compiles
    its logged programs itself."""
    return {
        "JAX_COMPILATION_CACHE_DIR": str(tmp_path_factory.mktemp("jax_cache")),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    }


def pytest_sessionfinish(session):
    """The tests' objects kept from the collections that end the run (pytest's check for
    unraisable exceptions, JAX's own at exit): each would walk the whole heap of JAX's caches
    again, seconds at the end of every worker. (`gc.freeze`: the objects made so far are
    left to the end of the process.)"""
    gc.freeze()


@pytest.fixture
def standard_promotion():
    """Standard dtype promotion for one test, for third-party code that relies on it: optax's
    Adam computes `decay ** count` with an int32 count (`optax.tree.bias_correction`)."""
    with jax.numpy_dtype_promotion("standard"):
        yield


@pytest.fixture
def wandb_env(monkeypatch, tmp_path):
    """Offline, quiet W&B whose settings and caches stay in tmp_path; returns the directory
    for the run (`tmp_path / "wb"`)."""
    for name, value in {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_CONSOLE": "off",
        "WANDB_DISABLE_GIT": "true",
        "WANDB_DISABLE_CODE": "true",
        "WANDB_CONFIG_DIR": os.fspath(tmp_path / "wandb-config"),
        "WANDB_CACHE_DIR": os.fspath(tmp_path / "wandb-cache"),
        "WANDB_DATA_DIR": os.fspath(tmp_path / "wandb-data"),
    }.items():
        monkeypatch.setenv(name, value)
    return tmp_path / "wb"

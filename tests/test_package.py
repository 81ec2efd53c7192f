"""The package as `pip install` gives it: a wheel built from the checkout (hatchling, as
`pip install .` builds it) holds the licence, `py.typed`, every config group and the Hydra
plugin that puts them on the search path, and one version; and a Hydra application of a user's
own, run from the unpacked wheel alone (not the checkout), finds the groups without naming them
and without importing `eqx_logs.config` itself."""

import email
import os
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

import eqx_logs

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
        + ["-w", str(out), str(ROOT)],
        check=True,
        timeout=300,
        capture_output=True,
    )
    (path,) = out.glob("eqx_logs-*.whl")
    return path


def _git_files(under: str) -> set[str]:
    listed = subprocess.run(
        ["git", "ls-files", under], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout.split()
    # the checkout as it is (a test run before `git add` sees new files too)
    return {p for p in listed if (ROOT / p).exists()} | {
        str(p.relative_to(ROOT)) for p in (ROOT / under).rglob("*.yaml")
    }


def test_wheel_contents(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "eqx_logs/py.typed" in names
    assert "eqx_logs/conf/__init__.py" in names
    assert "hydra_plugins/eqx_logs_searchpath/eqx_logs_searchpath.py" in names
    assert "hydra_plugins/__init__.py" not in names  # a namespace package, shared
    yamls = {p for p in _git_files("eqx_logs/conf") if p.endswith(".yaml")}
    assert {"eqx_logs/conf/logging/default.yaml", "eqx_logs/conf/logger/jsonl.yaml"} <= yamls
    assert yamls <= names, sorted(yamls - names)
    (licence,) = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
    text = zipfile.ZipFile(wheel).read(licence).decode()
    assert "Apache License" in text and "Version 2.0" in text
    assert text == (ROOT / "LICENSE").read_text()
    (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
    meta = email.message_from_bytes(zipfile.ZipFile(wheel).read(metadata))
    # one source for the version: eqx_logs.__version__, which pyproject.toml reads
    assert meta["Version"] == eqx_logs.__version__
    assert f"eqx_logs-{eqx_logs.__version__}-" in wheel.name
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "version" not in project and "version" in project["dynamic"]


APP_CONFIG = """\
defaults:
  - logging: default
  - logger: jsonl
  - instrument: "off"
  - _self_

hydra:
  run:
    dir: {run_dir}
"""

APP = """\
import hydra
from hydra.utils import instantiate


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg):
    import eqx_logs

    policy = instantiate(cfg.logging)
    logger = instantiate(cfg.logger)
    print("FROM", eqx_logs.__file__)
    print("POLICY", policy.interval, type(policy.reduce).__name__, policy.tags, policy.exclude)
    print("LOGGER", type(logger).__name__)
    print("INSTRUMENT", type(instantiate(cfg.instrument)).__name__)


main()
"""


def test_installed_groups_from_a_users_app(wheel, tmp_path):
    """The wheel unpacked on its own path (as site-packages would hold it), and an application
    that knows the groups only by its search path."""
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    app = tmp_path / "app"
    (app / "conf").mkdir(parents=True)
    (app / "conf" / "config.yaml").write_text(APP_CONFIG.format(run_dir=tmp_path / "run"))
    (app / "app.py").write_text(APP)
    # `-S`: no site-packages .pth files, so not the checkout's editable install either; the
    # environment's packages (hydra, jax) by path, after the unpacked wheel
    packages = [p for p in sys.path if p.endswith("site-packages")]
    path = os.pathsep.join([str(site), *packages])
    env = {**os.environ, "PYTHONPATH": path, "JAX_PLATFORMS": "cpu"}

    def run(*args: str, ok: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run(
            [sys.executable, "-S", "app.py", *args],
            cwd=app,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert (proc.returncode == 0) == ok, proc.stderr[-3000:]
        return proc

    def values(*overrides: str) -> dict[str, str]:
        lines = run(*overrides).stdout.splitlines()
        return dict(line.split(" ", 1) for line in lines if " " in line)

    out = values()
    assert Path(out["FROM"]).is_relative_to(site), out["FROM"]  # not the checkout's
    # logging/default.yaml: every 10th event, stacked, debug logs dropped
    assert out["POLICY"] == "10 Stack None ('debug',)"
    assert out["LOGGER"] == "JsonlLogger"
    assert out["INSTRUMENT"] == "Instrumentation"
    # logging/train.yaml: train-tagged scalars, the mean of every 100 steps
    out = values("logging=train", "logger=console", "instrument=norms")
    assert out["POLICY"].split()[:3] == ["1", "Mean", "('train',)"]
    assert out["LOGGER"] == "ConsoleLogger"
    # --help lists the options, and not the schemas among them
    groups = dict(line.split(": ", 1) for line in run("--help").stdout.splitlines() if ": " in line)
    assert groups["logger"].split(", ") == [
        "array", "console", "jsonl", "mlflow", "multi", "progress", "tensorboard", "trackio",
        "wandb",
    ]  # fmt: skip
    assert groups["logging"] == "debug, default, train"
    assert groups["instrument"] == "all, norms, off"
    # an option the package does not have: Hydra's error lists the package's options
    err = run("logger=nope", ok=False).stderr
    assert "tensorboard" in err and "jsonl" in err and "_base" not in err, err[-2000:]
    # a misspelt key of a schema: an error at composition, naming it
    err = run("logging.intervall=3", ok=False).stderr
    assert "intervall" in err, err[-2000:]

"""The package as `pip install` gives it: a wheel built from the checkout (hatchling, as
`pip install .` builds it) holds the licence, `py.typed`, every config group and the Hydra
plugin that puts them on the search path, and one version; and a Hydra application of a user's
own, run from the unpacked wheel alone (not the checkout), finds the groups without naming them
and without importing `eqx_logs.config` itself. `make demo` installs what the examples need,
not the test and docs tools."""

import email
import os
import re
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


def _make_rules(text: str) -> dict[str, tuple[list[str], list[str]]]:
    """The Makefile's rules: target -> (prerequisites, recipe lines)."""
    rules: dict[str, tuple[list[str], list[str]]] = {}
    current = None
    for line in text.splitlines():
        if line.startswith("\t") and current is not None:
            rules[current][1].append(line.strip())
        elif m := re.match(r"([^\s:=#][^:=]*):(?!=)(.*)", line):
            current = m[1].strip()
            rules[current] = (m[2].split(), [])
        elif line.strip() and not line.startswith("#"):
            current = None
    return rules


def _name(requirement: str) -> str:
    """A requirement's distribution name, normalized (PEP 503)."""
    return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9._-]+", requirement)[0]).lower()


def _imported(path: Path) -> set[str]:
    """The top-level modules a file imports at module level (not inside functions)."""
    import ast

    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_make_demo_installs_what_the_examples_need_only():
    """`make demo` installs the package with the `demo` extra, not the test and docs tools of
    `.[dev]` (which `make test` installs, and which, up to date, the demo uses as they are);
    and what that installs covers the examples' imports (the package's own module-level ones
    included) and matplotlib, for the plot command examples/train.py names: each comes from
    a distribution that the core dependencies and the extra require, directly or through
    theirs (as the installed distributions' metadata says)."""
    import importlib.metadata as metadata

    from packaging.requirements import Requirement

    rules = _make_rules((ROOT / "Makefile").read_text())
    (sentinel,) = rules["demo"][0]
    assert sentinel != ".venv/.installed", rules["demo"]
    recipe = " ".join(rules[sentinel][1])
    installs = re.findall(r"pip install [^;|&]*?-e '\.\[([^\]]*)\]'", recipe)
    assert installs == ["demo"], recipe
    assert "test .venv/.installed -nt pyproject.toml ||" in recipe  # a test install serves
    assert re.findall(r"-e '\.\[([^\]]*)\]'", " ".join(rules[".venv/.installed"][1])) == ["dev"]

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]

    def expand(requirements: list[str]) -> set[str]:  # eqx_logs[plot] -> plot's requirements
        out = set()
        for r in requirements:
            req = Requirement(r)
            if _name(req.name) == "eqx-logs":
                out |= expand([x for extra in req.extras for x in extras[extra]])
            else:
                out.add(_name(req.name))
        return out

    direct = expand(project["dependencies"]) | expand(extras["demo"])
    assert not direct & {"pytest", "hypothesis", "mkdocs", "ruff", "tensorboard", "diffrax"}
    closure, todo = set(), list(direct)
    while todo:
        name = todo.pop()
        if name in closure:
            continue
        closure.add(name)
        for r in metadata.requires(name) or []:
            req = Requirement(r)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(_name(req.name))

    modules = {"matplotlib"}
    for path in [*(ROOT / "examples").glob("*.py"), *(ROOT / "eqx_logs").rglob("*.py")]:
        modules |= _imported(path)
    modules -= {*sys.stdlib_module_names, "eqx_logs", "__future__"}
    providers = metadata.packages_distributions()
    missing = {
        m: providers.get(m)
        for m in modules
        if not {_name(d) for d in providers.get(m, [])} & closure
    }
    assert not missing, f"imported, but not installed by `make demo`: {missing}"


PRIVATE_JAX = ("jax._src", "jax.core", "jax.interpreters")


def _is_private(module: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in PRIVATE_JAX)


def _private_jax(source: str) -> list[str]:
    """The private JAX modules that `source` imports or reads as attributes (`jax._src.core`,
    `from jax._src import core`, `from jax import core`, `jax.interpreters.ad`)."""
    import ast

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if _is_private(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            found += [n for n in names if _is_private(n)][:1]
        elif isinstance(node, ast.Attribute):
            dotted = ast.unparse(node)
            if _is_private(dotted):
                found.append(dotted)
    return found


@pytest.mark.fast
def test_private_jax_api_only_in_compat():
    """Every use of private JAX API (what changes between JAX releases) is in the package
    `eqx_logs/_compat/`: no other module of eqx_logs imports or reads `jax._src`, `jax.core`
    or `jax.interpreters`."""
    for sample in ("import jax._src.core", "from jax._src import core", "from jax import core"):
        assert _private_jax(sample), sample
    assert _private_jax("x = jax.interpreters.ad.Zero")
    assert not _private_jax("import jax.numpy\nfrom jax import core_ops\nx = jax.lax.core")
    compat = ROOT / "eqx_logs" / "_compat"
    users = {
        str(path.relative_to(ROOT)): found
        for path in sorted((ROOT / "eqx_logs").rglob("*.py"))
        if (found := _private_jax(path.read_text()))
    }
    outside = {
        path: found for path, found in users.items() if not (ROOT / path).is_relative_to(compat)
    }
    assert not outside, f"private JAX API outside eqx_logs/_compat/ (move it there): {outside}"
    assert any((ROOT / path).is_relative_to(compat) for path in users), users

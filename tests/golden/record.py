"""Golden jaxprs: the programs eqx_logs emits, recorded so that a change that only moves code
can be shown to change none of them (issue 27).

    python tests/golden/record.py            record the goldens of the running JAX version
    python tests/golden/record.py --check    compare with them; exit 1 on a mismatch
    python tests/golden/record.py --draw     draw the oracle cases again (tests/golden/cases.txt)

What is recorded, per case, is `str(jax.make_jaxpr(transformed)(x, z))`, normalized (see
`normalize`), for:

- the random programs of tests/test_oracle.py and tests/test_tap_oracle.py, drawn once by
  hypothesis (`--draw`) and stored as their trees' reprs in cases.txt (so a newer hypothesis
  does not change them), each under the transforms of the oracle test it comes from
  (`spool`, `jax.jit(spool)`, `spool(value_and_grad)`, `spool(vmap)`, `vmap(spool)`,
  policies, reductions, `plant`, `tap` and its variants);
- the code blocks of README.md and of the documentation pages (as tests/test_docs.py runs
  them, each page alone): every call of a function that `eqx_logs.spool`, `tap`,
  `plant`, `logger.spool`, `logger.tap` or `logger.jit` returned records the jaxpr of that
  call on its arguments (arrays traced, everything else static, as `spool` filters them).

Goldens are per JAX major.minor version: tests/golden/jaxprs-jax<major.minor>.json.gz.
JAX runs on the CPU with one device and the test suite's strict promotion settings. The
values of the top-level constants are recorded too (a digest each), after the jaxpr.
"""

import os
import sys

# The environment JAX reads at import: fixed, so that the recording does not depend on the
# machine. The suite's promotion settings (tests/conftest.py), the CPU, one device.
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["JAX_NUMPY_DTYPE_PROMOTION"] = "strict"
os.environ["JAX_NUMPY_RANK_PROMOTION"] = "raise"
os.environ.pop("JAX_ENABLE_X64", None)
_flags = os.environ.get("XLA_FLAGS", "").split()
_flags = [f for f in _flags if not f.startswith("--xla_force_host_platform_device_count")]
os.environ["XLA_FLAGS"] = " ".join([*_flags, "--xla_force_host_platform_device_count=1"])

import argparse  # noqa: E402
import contextlib  # noqa: E402
import difflib  # noqa: E402
import fnmatch  # noqa: E402
import functools  # noqa: E402
import gzip  # noqa: E402
import hashlib  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
TESTS = HERE.parent
ROOT = TESTS.parent
sys.path.insert(0, str(TESTS))

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")

import test_oracle as O  # noqa: E402
import test_tap_oracle as TO  # noqa: E402

import eqx_logs  # noqa: E402
import eqx_logs.loggers  # noqa: E402

CASES = HERE / "cases.txt"
MUTATE = os.environ.get("EQX_LOGS_GOLDEN_MUTATE")  # a unit id: its programs get one more op


def golden_path(version: str | None = None) -> pathlib.Path:
    if version is None:
        version = ".".join(jax.__version__.split(".")[:2])
    return HERE / f"jaxprs-jax{version}.json.gz"


# ----------------------------------------------------------------------------------------
# Normalization
# ----------------------------------------------------------------------------------------

_TMP = None  # the temporary folder of the README and docs runs


def jaxpr_text(closed) -> str:
    """The printed jaxpr, then a line per top-level constant: its type and a digest of its
    value (the printed jaxpr shows constants' types only), the value itself if small."""
    lines = [str(closed)]
    for i, const in enumerate(closed.consts):
        if isinstance(const, jax.core.Tracer):  # a value of an enclosing trace
            lines.append(f"# const {i}: traced {const.aval.str_short()}")
            continue
        if jax.dtypes.issubdtype(getattr(const, "dtype", None), jax.dtypes.extended):
            const = jax.random.key_data(const)  # a PRNG key
        value = np.asarray(const)
        digest = hashlib.sha256(value.tobytes()).hexdigest()[:16]
        shown = f" {value.tolist()}" if value.size <= 8 else ""
        lines.append(f"# const {i}: {value.dtype}{list(value.shape)} sha256:{digest}{shown}")
    return "\n".join(lines)


def normalize(text: str) -> str:
    """What differs between identical runs: object addresses (JAX itself prints `at 0xXXXX`
    for a parameter's repr, not for every one), this checkout's path, the temporary folder
    the examples write to. Nothing else is touched."""
    text = re.sub(r"0x[0-9a-fA-F]{4,}", "0x…", text)
    if _TMP is not None:
        text = re.sub(re.escape(_TMP) + r"[^\s'\",)\]}]*", "<tmp>", text)
    return text.replace(str(ROOT), "<root>")


# ----------------------------------------------------------------------------------------
# The oracle cases: drawn once (--draw), stored as text
# ----------------------------------------------------------------------------------------


_NAMES = "Log Update Seq Scan Fori Cond Switch Jit Checkpoint ShardMap While Stats Instrument Sow"


def _namespace() -> dict:
    """The names a case's repr uses: the program nodes and Config of tests/test_oracle.py."""
    return {name: getattr(O, name) for name in [*_NAMES.split(), "Config"]}


def _shape(a) -> tuple[int, ...]:
    return tuple(int(n) for n in np.shape(a))


def _spec_kw(kw: dict, config=None) -> dict:
    """Policy/spool keywords with reductions as specs (`make_reduction` rebuilds them)."""
    out = dict(kw)
    if "reduce" in out:
        value = out["reduce"]
        out["reduce"] = (value,) if isinstance(value, str) else config.reduce
    if "rules" in out:
        out["rules"] = tuple(config.rules)
    return out


def _draw_kinds():
    """`{kind: (count, strategy)}`: each strategy draws a case dict, as the oracle test it is
    named after draws its arguments."""
    from hypothesis import assume, strategies as st

    def cases_of(kind, **kw):
        @st.composite
        def draw_case(draw):
            root, x0, z0 = draw(O.cases(**kw))
            return dict(kind=kind, root=root, x=_shape(x0), z=_shape(z0))

        return draw_case()

    @st.composite
    def capacity(draw):
        root, x0, z0 = draw(O.cases(loops=("scan", "fori", "while")))
        cap, keep = draw(st.integers(1, 5)), draw(st.sampled_from(["first", "last"]))
        return dict(kind="capacity", root=root, x=_shape(x0), z=(), capacity=cap, keep=keep)

    @st.composite
    def reduction(draw, batch=None):
        root, x0, z0, z_axis, spec, interval = draw(
            O.reduction_cases(batch=batch, shard_map=batch is None)
        )
        kind = "reduction" if batch is None else "batched"
        case = dict(kind=kind, root=root, x=_shape(x0), z=_shape(z0), z_axis=z_axis)
        return {**case, "spec": spec, "interval": interval}

    @st.composite
    def policy(draw):
        root, x0, z0, config, policy_kw, spool_kw = draw(O.policy_cases())
        return dict(
            kind="policy",
            root=root,
            x=_shape(x0),
            z=(),
            site=config.site,
            policy=_spec_kw(policy_kw, config),
            spool=_spec_kw(spool_kw, config),
        )

    @st.composite
    def stats(draw):
        root, x0, z0 = draw(O.cases(shard_map=True, extras=O.EXTRAS).filter(O._has_extras))
        return dict(kind="stats", root=root, x=_shape(x0), z=())

    @st.composite
    def stats_vmap(draw):
        root, xs, z0, batched = draw(O.extra_vmap_cases())
        return dict(kind="stats_vmap", root=root, x=_shape(xs), z=(), batched=batched)

    @st.composite
    def plant(draw):
        root, x0, z0, planted, transform = draw(O.plant_cases())
        values = {k: (_shape(v), np.asarray(v, np.float32).tolist()) for k, v in planted.items()}
        return dict(kind="plant", root=root, x=_shape(x0), z=(), planted=values, via=transform)

    @st.composite
    def tap(draw):
        root = draw(O.programs(loops=("scan", "fori", "while")))
        assume(O.count_logs(root) > 0)
        root = draw(O.in_outer_scan(root))
        shape, interval, variant = draw(O.x_shapes), draw(TO.intervals), draw(TO.VARIANTS)
        return dict(kind="tap", root=root, x=shape, z=(), interval=interval, variant=variant)

    @st.composite
    def tap_split(draw):
        root, _ = draw(TO.scan_programs())
        shape, interval = draw(O.x_shapes), draw(st.sampled_from([2, 3, 4, 5]))
        variant = draw(TO.VARIANTS)
        return dict(kind="tap_split", root=root, x=shape, z=(), interval=interval, variant=variant)

    @st.composite
    def tap_grad(draw):
        root = draw(st.one_of(O.programs(), TO.scan_programs().map(lambda p: p[0])))
        shape, interval = draw(O.x_shapes), draw(TO.intervals)
        where = draw(st.sampled_from(["tap_of_grad", "grad_of_tap"]))
        return dict(kind="tap_grad", root=root, x=shape, z=(), interval=interval, where=where)

    @st.composite
    def tap_vmap(draw):
        root, xs, z0, z_axis = draw(TO.batched_cases())
        interval = draw(TO.intervals)
        variant = draw(st.sampled_from(["vmap_of_tap", "jit_of_vmap_of_tap"]))
        if draw(st.booleans()):
            root = TO._with_loop_index(root)
        case = dict(kind="tap_vmap", root=root, x=_shape(xs), z=_shape(z0), z_axis=z_axis)
        return {**case, "interval": interval, "variant": variant}

    @st.composite
    def tap_of_vmap(draw):
        root, xs, z0, z_axis = draw(TO.batched_cases())
        case = dict(kind="tap_of_vmap", root=root, x=_shape(xs), z=_shape(z0), z_axis=z_axis)
        return {**case, "interval": draw(TO.intervals)}

    @st.composite
    def tap_select(draw):
        root = draw(O.programs(tags=O.TAGS, loops=("scan", "fori")))
        assume(O.count_logs(root) > 0)
        root = draw(O.in_outer_scan(root))
        shape, interval = draw(O.x_shapes), draw(TO.intervals)
        _, _, _, policy_kw, tap_kw = draw(TO.selections())
        case = dict(kind="tap_select", root=root, x=shape, z=(), interval=interval)
        return {**case, "policy": policy_kw, "tap": tap_kw, "in_spool": draw(st.booleans())}

    return {
        "spool": (50, cases_of("spool", shard_map=True)),
        "vmap": (25, cases_of("vmap", vmap_safe=True, batch=O.BATCH, shard_map=True)),
        "capacity": (15, capacity()),
        "reduction": (40, reduction()),
        "policy": (30, policy()),
        "batched": (30, reduction(batch=O.LANES)),
        "stats": (20, stats()),
        "stats_vmap": (12, stats_vmap()),
        "plant": (20, plant()),
        "tap": (25, tap()),
        "tap_split": (15, tap_split()),
        "tap_grad": (15, tap_grad()),
        "tap_vmap": (15, tap_vmap()),
        "tap_of_vmap": (15, tap_of_vmap()),
        "tap_select": (15, tap_select()),
    }


# What each kind's cases are spread over (round robin over the values found): hypothesis
# draws some values of a sampled choice far more often than others in a few examples.
STRATA = {
    "capacity": lambda c: c["keep"],
    "reduction": lambda c: c["spec"][0],
    "batched": lambda c: c["spec"][0],
    "stats_vmap": lambda c: c["batched"],
    "plant": lambda c: c["via"],
    "tap": lambda c: c["variant"],
    "tap_split": lambda c: c["variant"],
    "tap_grad": lambda c: c["where"],
    "tap_vmap": lambda c: c["variant"],
    "tap_select": lambda c: c["in_spool"],
}
POOL = 8  # examples drawn per case kept


def draw_cases() -> list[tuple[str, dict]]:
    """The cases, drawn by hypothesis (derandomized, no database: the same for the same
    hypothesis version): a pool of distinct examples per kind, `count` of them kept, spread
    over the kind's STRATA."""
    from hypothesis import HealthCheck, Phase, given, settings

    out = []
    for kind, (count, strategy) in _draw_kinds().items():
        pool: dict[str, dict] = {}

        @settings(
            max_examples=count * POOL,
            deadline=None,
            derandomize=True,
            database=None,
            phases=[Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(strategy)
        def collect(case):
            pool.setdefault(repr(case), case)

        collect()
        stratum = STRATA.get(kind, lambda c: None)
        groups: dict = {}
        for case in pool.values():
            groups.setdefault(stratum(case), []).append(case)
        kept: list[dict] = []
        while len(kept) < count and any(groups.values()):
            for group in groups.values():
                if group and len(kept) < count:
                    kept.append(group.pop(0))
        assert len(kept) == count, (kind, len(kept))
        out += [(f"{kind}-{i:03d}", case) for i, case in enumerate(kept)]
    return out


def write_cases(cases: list[tuple[str, dict]]) -> None:
    lines = [
        "# Oracle cases for tests/golden/record.py, drawn by `record.py --draw` (hypothesis,",
        "# derandomized). One case a line: `<id>: <dict>`, a Python expression over the names",
        "# of tests/test_oracle.py (the program nodes, Config); x and z are input shapes.",
    ]
    for case_id, case in cases:
        text = repr(case)
        assert eval(text, _namespace()) == case, case_id  # noqa: S307
        lines.append(f"{case_id}: {text}")
    CASES.write_text("\n".join(lines) + "\n")


def read_cases() -> list[tuple[str, dict]]:
    names = _namespace()
    out = []
    for line in CASES.read_text().splitlines():
        if line.startswith("#") or not line.strip():
            continue
        case_id, _, text = line.partition(": ")
        out.append((case_id, eval(text, dict(names))))  # noqa: S307
    return out


# ----------------------------------------------------------------------------------------
# The transforms of each kind of case
# ----------------------------------------------------------------------------------------


def _callback(logs, steps):
    """The tap callback of every tap case (never called: the programs are only traced)."""


def _inputs(case) -> tuple[np.ndarray, np.ndarray]:
    return np.zeros(case["x"], np.float32), np.zeros(case["z"], np.float32)


def _mutated(case_id: str, f):
    """With EQX_LOGS_GOLDEN_MUTATE=<this case's id>: one more operation in the program (to
    see that the check fails)."""
    if MUTATE != case_id:
        return f

    def g(x, z):
        return f(x + jnp.zeros((), x.dtype), z)

    return g


def _scalar(f):
    def scalar(x, z):
        x, z = f(x, z)
        return jnp.sum(x) + z

    return scalar


def _grad(f):
    return jax.value_and_grad(_scalar(f), argnums=(0, 1))


def _reduce_kw(kw: dict) -> dict:
    out = dict(kw)
    if "reduce" in out:
        out["reduce"] = O.make_reduction(out["reduce"])
    if "rules" in out:
        out["rules"] = {p: r if r == "drop" else O.make_reduction(r) for p, r in out["rules"]}
    return out


def transforms(case_id: str, case: dict) -> dict[str, object]:
    """`{name: thunk}`: each thunk builds the transformed function of the case afresh (a new
    `as_function`, so no case or transform depends on what was traced before)."""
    kind, root = case["kind"], case["root"]
    spool = eqx_logs.spool

    def fun(site=None):
        return _mutated(case_id, O.as_function(root, site))

    def tap_fun():
        return _mutated(case_id, TO.as_function(root))

    if kind in ("spool", "stats"):

        def grad_of_spool():  # README's `eqx.filter_grad` of a spooled model, in the oracle's
            spooled = spool(fun(), across="dev")
            return _grad(lambda x, z: spooled(x, z)[0])

        return {
            "spool": lambda: spool(fun(), across="dev"),
            "jit": lambda: jax.jit(spool(fun(), across="dev")),
            "grad": lambda: spool(_grad(fun()), across="dev"),
            "grad_of_spool": grad_of_spool,
        }
    if kind == "vmap" or kind == "stats_vmap":
        out = {"vmap_spool": lambda: jax.vmap(spool(fun(), across="dev"), (0, None))}
        if kind == "vmap" or not case["batched"]:
            out["spool_vmap"] = lambda: spool(jax.vmap(fun(), (0, None)), across="dev")
        return out
    if kind == "capacity":
        reduce = eqx_logs.Stack(capacity=case["capacity"], keep=case["keep"])
        return {"spool": lambda: spool(fun(), reduce=reduce)}
    if kind == "reduction":
        kw = dict(reduce=O.make_reduction(case["spec"]), interval=case["interval"])
        return {"spool": lambda: spool(fun(), across="dev", **kw)}
    if kind == "batched":
        kw = dict(reduce=O.make_reduction(case["spec"]), interval=case["interval"])
        axes = (0, case["z_axis"])
        return {
            "spool_vmap": lambda: spool(jax.vmap(fun(), axes), **kw),
            "vmap_spool": lambda: jax.vmap(spool(fun(), **kw), axes),
        }
    if kind == "policy":
        site = {k: None if r is None else O.make_reduction(r) for k, r in case["site"]}

        def policy():
            f = fun(site if site else None)
            return spool(
                f, policy=eqx_logs.Policy(**_reduce_kw(case["policy"])), **_reduce_kw(case["spool"])
            )

        return {"spool": policy}
    if kind == "plant":
        values = {k: np.asarray(v, np.float32).reshape(s) for k, (s, v) in case["planted"].items()}

        def planted():
            return eqx_logs.plant(fun(), values)

        via = case["via"]
        return {
            via: {
                "plant": planted,
                "spool": lambda: spool(planted(), across="dev"),
                "jit": lambda: jax.jit(spool(planted(), across="dev")),
                "grad": lambda: spool(_grad(planted()), across="dev"),
                "vmap": lambda: jax.vmap(spool(planted(), across="dev"), (0, None)),
            }[via]
        }
    if kind in ("tap", "tap_split"):
        variant, interval = case["variant"], case["interval"]
        return {variant: lambda: TO._transform(tap_fun(), variant, interval, _callback)}
    if kind == "tap_grad":
        where, interval = case["where"], case["interval"]

        def tap_grad():
            if where == "tap_of_grad":
                return eqx_logs.tap(_grad(tap_fun()), callback=_callback, interval=interval)
            tapped = eqx_logs.tap(_scalar(tap_fun()), callback=_callback, interval=interval)
            return jax.value_and_grad(tapped, argnums=(0, 1))

        return {where: tap_grad}
    if kind == "tap_vmap":
        variant, interval, axes = case["variant"], case["interval"], (0, case["z_axis"])

        def vmap_of_tap():
            f = jax.vmap(eqx_logs.tap(tap_fun(), callback=_callback, interval=interval), axes)
            return jax.jit(f) if variant.startswith("jit") else f

        return {variant: vmap_of_tap}
    if kind == "tap_of_vmap":
        interval, axes = case["interval"], (0, case["z_axis"])
        f = lambda: jax.vmap(tap_fun(), axes)  # noqa: E731
        return {"tap_of_vmap": lambda: eqx_logs.tap(f(), callback=_callback, interval=interval)}
    if kind == "tap_select":

        def select():
            tapped = eqx_logs.tap(
                tap_fun(),
                callback=_callback,
                policy=eqx_logs.Policy(**case["policy"]),
                interval=case["interval"],
                **case["tap"],
            )
            return spool(tapped) if case["in_spool"] else tapped

        return {"spool_of_tap" if case["in_spool"] else "tap": select}
    raise AssertionError(kind)


def _jaxpr_text(make, args) -> str:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            text = jaxpr_text(jax.make_jaxpr(make())(*args))
    except Exception as e:  # what the library raises is what it emits, too
        text = f"raised {type(e).__name__}: {e}"
    return normalize(text)


def record_case(case_id: str, case: dict) -> dict[str, str]:
    args = _inputs(case)
    return {
        f"{case_id}/{name}": _jaxpr_text(make, args)
        for name, make in transforms(case_id, case).items()
    }


# ----------------------------------------------------------------------------------------
# README and documentation examples
# ----------------------------------------------------------------------------------------


class _Recorder:
    """Records, for every call of a wrapper that eqx_logs's public transforms return, the
    jaxpr of that call (once per object and signature, once per distinct text and block)."""

    def __init__(self):
        self.active = False
        self.busy = False  # inside a recording: the calls it makes are not recorded
        self.labels: dict[type, str] = {}
        self.seen: set = set()
        self.keep: list = []  # the objects whose ids are in `seen`
        self.entries: list[tuple[str, str]] = []

    def install(self, tmp: str) -> None:
        """Wrap the `__call__` of the types that the public transforms return (found by
        calling them, not by name: so it holds whatever the types become)."""
        if self.labels:
            return
        f = lambda x: x  # noqa: E731
        logger = eqx_logs.loggers.ArrayLogger(os.path.join(tmp, "never-written"))
        state = logger.init()
        made = [
            ("spool", eqx_logs.spool(f)),
            ("spool", eqx_logs.spool(functools.partial(f))),
            ("spool", eqx_logs.spool()(f)),
            ("spool", eqx_logs.spool(eqx.nn.Lambda(f))),  # a model
            ("tap", eqx_logs.tap(f)),
            ("plant", eqx_logs.plant(f, {})),
            ("logger.spool", logger.spool(f, state)),
            ("logger.tap", logger.tap(f, state)),
            ("logger.jit", logger.jit(f, state)),
        ]
        for label, obj in made:
            cls = type(obj)
            if cls not in self.labels:
                self.labels[cls] = label
                cls.__call__ = self._wrap(cls.__call__, label)

    def _wrap(self, call, label):
        recorder = self

        def __call__(obj, *args, **kwargs):
            if recorder.active and not recorder.busy:
                recorder.record(label, call, obj, args, kwargs)
            return call(obj, *args, **kwargs)

        __call__.__qualname__ = call.__qualname__
        return __call__

    def record(self, label, call, obj, args, kwargs) -> None:
        leaves, treedef = jax.tree.flatten((obj, args, kwargs))
        static = [x if not eqx.is_array(x) else None for x in leaves]
        signature = (
            id(obj),
            label,
            str(treedef),
            tuple(
                (x.shape, str(x.dtype), bool(getattr(x, "weak_type", False)))
                if eqx.is_array(x)
                # (`logger.jit(..., step="i")` traces a Python-int step: one program for all)
                else type(x).__name__
                if label == "logger.jit" and type(x) is int
                else (type(x).__name__, repr(x))
                for x in leaves
            ),
        )
        if signature in self.seen:
            return
        self.seen.add(signature)
        self.keep.append(obj)
        dynamic = [x for x in leaves if eqx.is_array(x)]

        def traced(dynamic):
            it = iter(dynamic)
            full = [next(it) if s is None else s for s in static]
            o, a, k = jax.tree.unflatten(treedef, full)
            # the outputs' arrays: a model returned by a step has functions among its leaves
            return [x for x in jax.tree.leaves(call(o, *a, **k)) if eqx.is_array_like(x)]

        self.busy = True
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                text = jaxpr_text(jax.make_jaxpr(traced)(dynamic))
        except Exception as e:
            text = f"raised {type(e).__name__}: {e}"
        finally:
            self.busy = False
        self.entries.append((label, normalize(text)))


RECORDER = _Recorder()


def _readme_blocks() -> list[tuple[str, str]]:
    readme = (pathlib.Path(__file__).parent.parent.parent / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    return [(f"b{i:02d}", code) for i, code in enumerate(blocks)]


def _docs_blocks() -> list[tuple[str, str]]:
    import test_docs

    out = []
    for page in test_docs._guide()[1:]:  # README.md is a unit of its own
        blocks = re.findall(r"```python\n(.*?)```", test_docs._page(page), flags=re.S)
        out += [(f"{page}/b{i:02d}", code) for i, code in enumerate(blocks)]
    return out


@contextlib.contextmanager
def _mutated_log(mutate: bool):
    """With EQX_LOGS_GOLDEN_MUTATE=<unit>/<block>: one more operation on every array that
    the block's functions log (to see that the check fails)."""
    if not mutate:
        yield
        return
    real = eqx_logs.log

    @functools.wraps(real)
    def log(*args, **kwargs):
        args = jax.tree.map(lambda v: v + jnp.zeros((), v.dtype) if eqx.is_array(v) else v, args)
        return real(*args, **kwargs)

    eqx_logs.log = log
    try:
        yield
    finally:
        eqx_logs.log = real


def record_examples(unit: str) -> dict[str, str]:
    """Run the blocks of README.md ("readme") or of the documentation pages ("docs"), each
    page's in a namespace of its own, as their tests do, recording what each block's
    transformed functions emit: `<unit>/<block>/<label>/<k>`, the k-th distinct jaxpr of
    that label in that block."""
    global _TMP
    tmp = tempfile.mkdtemp(prefix="eqx-logs-golden-")
    _TMP, old_tempdir = tmp, tempfile.tempdir
    tempfile.tempdir = tmp  # the blocks' `tempfile.mkdtemp()`: normalized as <tmp>
    RECORDER.install(tmp)
    out: dict[str, str] = {}
    namespace: dict = {}
    cwd = os.getcwd()
    try:
        os.chdir(tmp)
        blocks = _readme_blocks() if unit == "readme" else _docs_blocks()
        page = None
        for name, code in blocks:
            if name.rpartition("/")[0] != page:  # each page runs alone, as its test runs it
                page, namespace = name.rpartition("/")[0], {}
            if f"{unit}/{name}" in SKIP_BLOCKS:
                continue
            RECORDER.entries = []
            RECORDER.active = True
            try:
                with (
                    contextlib.redirect_stdout(io.StringIO()),
                    warnings.catch_warnings(),
                    _mutated_log(MUTATE == f"{unit}/{name}"),
                ):
                    warnings.simplefilter("ignore")
                    exec(compile(code, f"{unit}:{name}", "exec"), namespace)  # noqa: S102
                    jax.effects_barrier()
            except Exception as e:
                RECORDER.entries.append(("block", f"raised {type(e).__name__}: {e}"))
            finally:
                RECORDER.active = False
            counts: dict[str, int] = {}
            texts: set = set()
            for label, text in RECORDER.entries:
                if (label, text) in texts:
                    continue
                texts.add((label, text))
                k = counts.get(label, 0)
                counts[label] = k + 1
                out[f"{unit}/{name}/{label}/{k}"] = text
    finally:
        os.chdir(cwd)
        tempfile.tempdir = old_tempdir
        _TMP = None
        shutil.rmtree(tmp, ignore_errors=True)
    return out


# ----------------------------------------------------------------------------------------
# Units, the goldens, the check
# ----------------------------------------------------------------------------------------

# The fast subset (tests/test_golden_jaxprs.py, the default suite): the first two cases of
# every kind and the README's examples.
FAST_PER_KIND = 2
FAST_SKIP_BLOCKS: tuple[str, ...] = ()
SKIP_BLOCKS: set[str] = set()  # blocks of the README or docs not run (nor compared)


def units() -> dict[str, object]:
    """`{unit id: thunk -> {golden id: text}}`, in a fixed order: every oracle case, then the
    README's blocks, then the documentation's."""
    out = {}
    for case_id, case in read_cases():
        out[case_id] = functools.partial(record_case, case_id, case)
    out["readme"] = functools.partial(record_examples, "readme")
    out["docs"] = functools.partial(record_examples, "docs")
    return out


def fast_units(all_units) -> list[str]:
    picked, per_kind = [], {}
    for unit in all_units:
        if unit in ("readme", "docs"):
            continue
        kind = unit.rsplit("-", 1)[0]
        if per_kind.get(kind, 0) < FAST_PER_KIND:
            per_kind[kind] = per_kind.get(kind, 0) + 1
            picked.append(unit)
    return [*picked, "readme"]


def select_units(all_units, patterns: list[str], subset: str | None) -> list[str]:
    names = list(all_units)
    if subset == "fast":
        names = fast_units(names)
        SKIP_BLOCKS.update(FAST_SKIP_BLOCKS)
    if patterns:
        names = [u for u in names if any(fnmatch.fnmatchcase(u, p) for p in patterns)]
    return names


def run_units(all_units, names: list[str], reverse: bool = False, verbose: bool = False):
    out: dict[str, str] = {}
    times: dict[str, float] = {}
    for name in reversed(names) if reverse else names:
        start = time.perf_counter()
        out.update(all_units[name]())
        times[name] = time.perf_counter() - start
        if verbose:
            print(f"{name}: {times[name]:.2f}s", file=sys.stderr)
    return dict(sorted(out.items())), times


def _cases_digest() -> str:
    return hashlib.sha256(CASES.read_bytes()).hexdigest()


def save(entries: dict[str, str], path: pathlib.Path) -> None:
    data = {
        "jax": jax.__version__,
        "jaxlib": jax.lib.__version__ if hasattr(jax.lib, "__version__") else None,
        "cases_sha256": _cases_digest(),
        "entries": dict(sorted(entries.items())),
    }
    raw = json.dumps(data, indent=0, sort_keys=False, ensure_ascii=False).encode()
    with open(path, "wb") as f, gzip.GzipFile(fileobj=f, mode="wb", mtime=0, filename="") as gz:
        gz.write(raw)


def load(path: pathlib.Path) -> dict:
    with gzip.open(path, "rb") as f:
        return json.loads(f.read().decode())


def _unit_of(golden_id: str) -> str:
    return golden_id.split("/", 1)[0]


_BINDER = re.compile(r"\b([a-z]+):(?:[a-z]+[0-9]*|key<\w+>)\[")


def raw_diff(want: str, got: str) -> list[str]:
    return list(difflib.unified_diff(want.splitlines(), got.splitlines(), lineterm="", n=2))[2:]


def structural_diff(want: str, got: str, context: int = 2) -> list[str]:
    """A diff of two printed jaxprs that lines up their equations ignoring variable names
    (one more equation renames every variable after it): the lines added or removed, with
    context, and how many more lines differ in their variable names only (`--raw` shows
    them)."""
    a, b = want.splitlines(), got.splitlines()
    names = set(_BINDER.findall(want)) | set(_BINDER.findall(got))

    def masked(line):
        return re.sub(r"\b[a-z]+\b", lambda m: "_" if m.group(0) in names else m.group(0), line)

    matcher = difflib.SequenceMatcher(None, [masked(x) for x in a], [masked(x) for x in b], False)
    out, renamed = [], 0
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            renamed += sum(a[i] != b[j] for i, j in zip(range(i1, i2), range(j1, j2)))
            continue
        out.append(f"@@ golden line {i1 + 1}, now line {j1 + 1} @@")
        out += [f"  {x}" for x in b[max(0, j1 - context) : j1]]
        out += [f"- {x}" for x in a[i1:i2]] + [f"+ {x}" for x in b[j1:j2]]
        out += [f"  {x}" for x in b[j2 : j2 + context]]
    if renamed:
        out.append(f"(and {renamed} lines that differ in variable names only: --raw shows them)")
    return out


def compare(
    want: dict[str, str],
    got: dict[str, str],
    names: list[str],
    shown: int,
    lines: int,
    raw: bool = False,
) -> bool:
    """Print the differences between the goldens of the units `names` and what they emit now:
    the ids of every mismatching, missing and new jaxpr, and a unified diff of the first
    `shown` mismatches (at most `lines` lines each; `raw`: a plain unified diff, else
    `structural_diff`). True if they agree."""
    selected = set(names)
    want = {
        k: v
        for k, v in want.items()
        if _unit_of(k) in selected and not any(k.startswith(b + "/") for b in SKIP_BLOCKS)
    }
    missing = sorted(set(want) - set(got))
    new = sorted(set(got) - set(want))
    changed = sorted(k for k in set(want) & set(got) if want[k] != got[k])
    if not (missing or new or changed):
        print(
            f"golden jaxprs: {len(got)} jaxprs of {len(names)} units match ({golden_path().name})"
        )
        return True
    counted = f"{len(got)} jaxprs of {len(names)} units"
    print(f"golden jaxprs: MISMATCH against {golden_path().name} ({counted})")
    for title, ids in (("changed", changed), ("no longer emitted", missing), ("new", new)):
        if ids:
            print(f"  {title} ({len(ids)}): {', '.join(ids[:40])}{' ...' if len(ids) > 40 else ''}")
    for golden_id in changed[:shown]:
        diff = (raw_diff if raw else structural_diff)(want[golden_id], got[golden_id])
        print(f"\n--- {golden_id} (golden)\n+++ {golden_id} (now)")
        print("\n".join(diff[:lines]))
        if len(diff) > lines:
            print(f"... ({len(diff) - lines} more lines; --show {golden_id} prints the jaxpr)")
    for golden_id in new[: max(0, shown - len(changed))]:
        print(f"\n{golden_id} (new):\n" + "\n".join(got[golden_id].splitlines()[:lines]))
    print(
        "\nIf the change is meant to change the emitted programs, record again "
        "(python tests/golden/record.py, for each JAX version) and say so in the commit."
    )
    return False


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare with the goldens")
    parser.add_argument("--draw", action="store_true", help="draw cases.txt again (hypothesis)")
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="GLOB",
        help="units to run (globs on unit ids: spool-003, 'tap*', readme, docs)",
    )
    parser.add_argument("--subset", choices=["fast"], help="the fast subset of the units")
    parser.add_argument(
        "--show", metavar="ID", help="print the current text of a jaxpr id (and exit)"
    )
    parser.add_argument("--reverse", action="store_true", help="run the units in reverse order")
    parser.add_argument("--shown", type=int, default=3, help="mismatches diffed in full (3)")
    parser.add_argument("--lines", type=int, default=80, help="lines per diff (80)")
    parser.add_argument("--raw", action="store_true", help="plain unified diffs")
    parser.add_argument("--out", type=pathlib.Path, help="write the recording here instead")
    parser.add_argument("-v", "--verbose", action="store_true", help="time each unit")
    args = parser.parse_args(argv)

    if args.draw:
        write_cases(draw_cases())
        print(f"wrote {CASES.relative_to(ROOT)}")
    all_units = units()
    if args.show:
        got, _ = run_units(all_units, [_unit_of(args.show)])
        if args.show not in got:
            print(f"no jaxpr {args.show!r}; the unit emits: {', '.join(got)}")
            return 1
        print(got[args.show])
        return 0
    names = select_units(all_units, args.only, args.subset)
    start = time.perf_counter()
    got, times = run_units(all_units, names, args.reverse, args.verbose)
    elapsed = time.perf_counter() - start
    if args.verbose:
        slow = sorted(times.items(), key=lambda t: -t[1])[:5]
        print(
            f"{len(names)} units, {len(got)} jaxprs in {elapsed:.1f}s; slowest {slow}",
            file=sys.stderr,
        )
    path = golden_path()
    if args.check:
        if not path.exists():
            print(f"no goldens for jax {jax.__version__}: {path.relative_to(ROOT)} (record them)")
            return 1
        golden = load(path)
        if golden["cases_sha256"] != _cases_digest():
            print(f"{CASES.name} changed since {path.name} was recorded: record again")
            return 1
        return 0 if compare(golden["entries"], got, names, args.shown, args.lines, args.raw) else 1
    if args.out is None and (args.only or args.subset):
        print("record all units (no --only/--subset), or pass --out", file=sys.stderr)
        return 2
    save(got, args.out or path)
    print(
        f"recorded {len(got)} jaxprs of {len(names)} units in {elapsed:.0f}s: {(args.out or path)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`spool` around `jax.shard_map` and `jax.pmap` on 4 CPU devices: each device reduces its own
events, and a key's output has one axis per manual mesh axis after the event axis. The checks
run in a subprocess (`devices_checks.py`: the device count is fixed when JAX starts) against
the same shard_map returning its values by hand, or numpy."""

import json
import os
import subprocess
import sys

import pytest
from helpers import devices_env

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def results():
    env = devices_env(4)
    run = subprocess.run(
        [sys.executable, os.path.join(HERE, "devices_checks.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def _ok(results, name):
    got = results[name]
    assert "error" not in got, got.get("error")
    return got


def test_stacked_per_device_laid_out_over_the_mesh(results):
    got = _ok(results, "stack")
    assert got["out"] and got["v"] and got["s"] and got["steps"]
    assert got["shape"] == [3, 4]  # (events, devices)
    assert got["spec"] == "P(None, 'd')"  # a global array over the devices: nothing gathered
    assert got["count"] == [3, 3, 3, 3]


def test_under_jit(results):
    got = _ok(results, "jit")
    assert got["out"] and got["v"] and got["spec"] == "P(None, 'd')"


@pytest.mark.parametrize("name", ["mean", "var", "max", "last", "sum", "interval"])
def test_every_device_reduces_its_own_events(results, name):
    assert _ok(results, "reductions")[name]


def test_two_dimensional_mesh_and_partly_manual_shard_map(results):
    got = _ok(results, "mesh2")
    assert got["both"] and got["partial"]
    assert got["shape"] == [1, 2, 2]  # one axis per manual mesh axis, in mesh order


def test_events_with_no_value_counted_per_device_and_across(results):
    got = _ok(results, "no_value")
    assert got == dict.fromkeys(got, True) and len(got) == 6, got


def test_explicit_mesh_axes(results):
    # `jax.make_mesh` gives Explicit axes: the states entering the shard_map are laid out as
    # its specs say (they were replicated, which shard_map rejects)
    got = _ok(results, "explicit")
    assert got["spec"] == "P(None, 'd')"
    assert got["out"] and got["v"] and got["mean"] and got["across"]
    assert got["ragged_counts"] and got["partial"]
    # a stack across Explicit axes: all of them, and one of two
    assert got["across_stack"] and got["across_stack_2d"]


def test_tap_calls_back_per_device_with_mesh_coordinates(results):
    got = _ok(results, "tap")
    assert got["stack"] and got["v_rows"]  # every device's events once, steps + coordinates
    assert got["interval"]  # `interval` counts each device's own events
    assert got["pmap"]
    # only some axes manual: said at trace time, not a lowering error
    assert "every axis manual" in got["partial"] and "eqx_logs.spool" in got["partial"]


def test_loggers_on_sharded_programs(results):
    # jax.debug.callback(ordered=True) is refused by programs over several devices: every
    # logger failed there
    got = _ok(results, "loggers")
    assert got["spool_jit"] and got["spool_eager"] and got["tap"] and got["tap_shard_map"]


def test_explicit_sharding_without_a_mesh_context(results):
    got = _ok(results, "explicit_no_mesh_context")
    assert got["h"] and got["spec"] == "P(None, 'd', None)"


def test_pmap(results):
    got = _ok(results, "pmap")
    assert got["out"] and got["p"]


def test_devices_keep_different_numbers_of_events(results):
    got = _ok(results, "cond_per_device")
    assert got["counts"] and got["rows"] and got["values"]


def test_vmap_inside_shard_map(results):
    assert _ok(results, "vmap_inside")["r"]


def test_grad_through_shard_map(results):
    got = _ok(results, "grad")
    assert got["grad"] and got["h"]


def test_a_key_logged_inside_and_outside_a_shard_map_is_an_error(results):
    message = _ok(results, "inside_and_outside")["message"]
    assert message is not None
    assert "'k'" in message and "shard_map" in message and "devices_checks.py" in message


@pytest.mark.parametrize(
    "name",
    [
        *("mean", "sum", "max", "min", "var", "count", "stack", "first", "last", "v", "steps"),
        *("histogram", "sample"),
    ],
)
def test_across_merges_the_devices_results_with_each_reductions_merge(results, name):
    # Stack, First and Last in device order: device 0's events, then device 1's, ...
    assert _ok(results, "across")[name]


def test_across_with_a_different_number_of_events_per_device(results):
    got = _ok(results, "across")
    assert got["ragged"] and got["ragged_rows"] and got["count_total"]


def test_across_one_or_both_axes_of_a_two_dimensional_mesh(results):
    got = _ok(results, "across")
    assert got["mesh2_b"] and got["mesh2_both"]


def test_across_an_axis_no_shard_map_has_is_an_error(results):
    message = _ok(results, "across")["typo"]
    assert message is not None and "'x'" in message and "['d']" in message


@pytest.mark.parametrize("name", ["one", "two", "fine"])
def test_first_nonfinite_names_the_lowest_device_that_found_one(results, name):
    # device 2's block goes non-finite at step 3; in "two", devices 1 (step 4) and 3 (step 1):
    # the devices run at once, the lowest-numbered is reported; numpy says which, eager and
    # under jit alike
    got = _ok(results, "first_nonfinite")
    assert got["two_lowest_not_earliest"]
    assert got[name] and got[f"{name}_jit"]


@pytest.mark.parametrize("name", ["lane", "before", "pmap", "mesh2", "explicit"])
def test_first_nonfinite_with_lanes_pmap_and_meshes(results, name):
    assert _ok(results, "first_nonfinite")[name]


def test_first_nonfinite_per_run_under_a_vmap_outside_the_spool(results):
    assert _ok(results, "first_nonfinite")["runs"] == [True, True, True]


@pytest.mark.parametrize("name", ["one", "two", "fine"])
def test_first_nonfinite_any_looks_inside_the_shard_map(results, name):
    got = _ok(results, "first_nonfinite_any")
    assert got[name] and got[f"{name}_jit"]

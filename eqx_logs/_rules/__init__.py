"""One rule per higher-order primitive: how spool counts and evaluates its logs.

A rule has two functions:

- `count(plan, eqn) -> Counts`: the static bound on events per key inside the equation (with
  `plan.count` for its jaxprs, `_interpret/_plan.py`);
- `apply(interp, eqn, invals, states) -> (outs, states)`: evaluate the equation in the current
  trace, rebuilt with JAX's public constructors (`lax.scan`, `lax.while_loop`, `lax.switch`,
  `jax.checkpoint`) and with the reduction states of its keys threaded through.

To support a new primitive, write these two functions and `register` them under its name.

The rules, by primitive family:

- `_table`: the `Rule` tuple, the table `RULES` (by primitive name) and `register`;
- `_calls`: inlined calls (jit, closed_call, custom_vmap), remat, `inline_copy_apply`;
- `_custom`: custom_jvp / custom_vjp;
- `_solves`: custom_linear_solve, Equinox's opaque primitives, hi primitives (custom_root);
- `_loops`: scan, while;
- `_cond`: cond / switch;
- `_shard_map`: shard_map (and pmap), `per_device_blocks`.
"""

# Imported for their registrations, in the order of `RULES` (which isort would change).
# isort: off
from . import (
    _calls as _calls,
    _custom as _custom,
    _solves as _solves,
    _loops as _loops,
    _cond as _cond,
    _shard_map as _shard_map,
)

# isort: on
from ._calls import inline_copy_apply as inline_copy_apply
from ._shard_map import per_device_blocks as per_device_blocks
from ._table import RULES as RULES, Rule as Rule, register as register, split_at as split_at

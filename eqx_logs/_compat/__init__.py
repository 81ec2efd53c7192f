"""Every use of private JAX API, in one package.

JAX changes its internals between minor releases (jax 0.10 has `ClosedJaxpr` and a scan with
`num_consts`/`num_carry`; jax 0.12 folds constants into `Jaxpr` and describes a scan's operands
with a flat tree). The rest of eqx_logs sees only the small, stable vocabulary re-exported here
(`from . import _compat`, then `_compat.NAME`); no other module imports `jax._src`:

- `_types`: the JAX types named elsewhere (`Jaxpr`, `JaxprEqn`, `Primitive`, `Effect`, ...);
- `_equinox`: the implementations of Equinox's primitives (`equinox_impl`);
- `_higher_order`: the higher-order primitives by name, and one accessor for each
  (`scan_parts`, `while_parts`, ...);
- `_jaxprs`: `unpack`/`sub_jaxprs`/`strip_eqn`, reading and rebuilding jaxprs without
  mutating them; `bind_eqn`, evaluating one equation as `jax.core.eval_jaxpr` would; where
  an equation comes from (`eqn_location`, `current_location`);
- `_backward_logs`: JAX's backward-pass logs (jax >= 0.12, `defvjp_with_logs`), handed to
  eqx_logs where JAX runs each backward rule (`on_backward_logs`, `rule_output`);
- `_custom`: custom_jvp/custom_vjp calls bound again with extra inputs and outputs;
- `_hoisting`: `keep_in_loops`, partial-eval rules that stop JAX hoisting logs out of loops;
- `_registry`: `register_effect` (an effect type of our own, allowed everywhere a log may
  appear); `logging_enabled`, `scope_prefix`, `planting` (JAX config states in the jit key
  and the trace context); the rule registries of primitives (`def_jvp`, `def_batching`,
  `def_lowering`, `wrap_batching`, ...);
- `_tangents`: tangents as JAX's rules receive them (`is_zero`, `zero_tangent`, `instantiate`,
  `is_linear_operand`), `leading_axes_aval`;
- `_host`: `host_callback`, a host callback that keeps its order on any number of devices.

Each module imports only modules listed before it, and each piece of state (a config state,
a registration, a version check) is made in one module, once. `tests/test_compat.py` checks the
vocabulary on the installed JAX version.
"""

from ._backward_logs import (
    BACKWARD_LOGS as BACKWARD_LOGS,
    on_backward_logs as on_backward_logs,
)
from ._custom import (
    bind_custom_jvp as bind_custom_jvp,
    bind_custom_rules_in as bind_custom_rules_in,
    bind_custom_vjp as bind_custom_vjp,
    custom_rule_jaxpr as custom_rule_jaxpr,
)
from ._equinox import (
    EQUINOX_PRIMITIVES as EQUINOX_PRIMITIVES,
    derivative_noinline as derivative_noinline,
    equinox_impl as equinox_impl,
)
from ._higher_order import (
    COND as COND,
    CUSTOM_CALLS as CUSTOM_CALLS,
    CUSTOM_JVP as CUSTOM_JVP,
    CUSTOM_VJP as CUSTOM_VJP,
    CUSTOM_VMAP as CUSTOM_VMAP,
    HI_CALL as HI_CALL,
    INLINE_CALLS as INLINE_CALLS,
    LINEAR_SOLVE as LINEAR_SOLVE,
    REMAT as REMAT,
    SCAN as SCAN,
    SHARD_MAP as SHARD_MAP,
    WHILE as WHILE,
    call_jaxpr as call_jaxpr,
    close as close,
    cond_branches as cond_branches,
    cond_platforms as cond_platforms,
    hi_forward as hi_forward,
    hi_name as hi_name,
    linear_solve_parts as linear_solve_parts,
    recomputes as recomputes,
    remat_options as remat_options,
    scan_options as scan_options,
    scan_parts as scan_parts,
    shard_map_parts as shard_map_parts,
    switch as switch,
    vary as vary,
    varying_axes as varying_axes,
    while_parts as while_parts,
)
from ._hoisting import (
    hoisting_codes as hoisting_codes,  # tests/test_compat.py
    keep_in_loops as keep_in_loops,
    splitting_codes as splitting_codes,  # tests/test_compat.py
)
from ._host import (
    HostEffect as HostEffect,
    host_callback as host_callback,
    host_effect as host_effect,
    host_p as host_p,
)
from ._jaxprs import (
    any_eqn as any_eqn,
    bind_eqn as bind_eqn,
    current_location as current_location,
    eqn_location as eqn_location,
    eqns as eqns,
    function_name as function_name,
    in_backward_pass as in_backward_pass,
    is_high as is_high,
    is_jaxpr as is_jaxpr,
    is_traced as is_traced,
    is_tracer as is_tracer,
    primitive_jvp as primitive_jvp,
    staging as staging,
    strip_eqn as strip_eqn,
    strip_jaxpr as strip_jaxpr,
    sub_jaxprs as sub_jaxprs,
    trace_on_avals as trace_on_avals,
    tracing as tracing,
    unpack as unpack,
    with_params as with_params,
)
from ._registry import (
    axis_size_and_name as axis_size_and_name,
    def_batching as def_batching,
    def_batching_with_axis as def_batching_with_axis,
    def_jvp as def_jvp,
    def_lowering as def_lowering,
    def_no_derivative as def_no_derivative,
    def_primal_only as def_primal_only,
    def_transpose as def_transpose,
    explicit_spec as explicit_spec,
    logging_enabled as logging_enabled,
    not_mapped as not_mapped,
    planting as planting,
    register_effect as register_effect,
    scope_prefix as scope_prefix,
    user_axis_name as user_axis_name,
    wrap_batching as wrap_batching,
    wrap_every_batching as wrap_every_batching,
)
from ._tangents import (
    instantiate as instantiate,
    is_linear_operand as is_linear_operand,
    is_zero as is_zero,
    leading_axes_aval as leading_axes_aval,
    zero_tangent as zero_tangent,
)
from ._types import (
    DropVar as DropVar,
    Effect as Effect,
    Jaxpr as Jaxpr,
    JaxprEqn as JaxprEqn,
    Literal as Literal,
    Primitive as Primitive,
    ShapedArray as ShapedArray,
)

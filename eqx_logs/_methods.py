"""Methods of Equinox modules, bound cheaply."""

import types
from collections.abc import Callable
from typing import Any


def method(module: Any, name: str) -> Callable:
    """`module.<name>`, bound as a plain method. Equinox builds a Module for every access of a
    method on an instance (tens of microseconds each), and the interpreter calls reduction
    methods per key and per event while it traces."""
    return types.MethodType(getattr(type(module), name), module)

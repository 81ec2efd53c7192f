"""griffe extension: an Equinox module's signature in the API reference is its `__init__`.

Equinox makes a module's `__init__` from its fields, as `dataclasses` does, but griffe reads
the source and only knows `@dataclass` itself, so `EMA(decay)`, `Sample(k, key=None)` or
`JsonlLogger(path, *, every_process=False)` would be shown without a signature. For each class
of the package without an `__init__` of its own in the source, this takes the parameters of
the class's runtime `__init__` (the one Equinox made), with the annotations as the source
writes them where the field is declared in the package, and gives the class that `__init__`.
"""

import importlib
import inspect
from typing import Any

import griffe


def _classes(obj: griffe.Object):
    for member in obj.members.values():
        if member.is_alias:
            continue
        if member.is_class:
            yield member
        if member.is_module or member.is_class:
            yield from _classes(member)


def _annotation(cls: griffe.Class, name: str) -> Any:
    """The field's annotation as written in the source, in the class or a base of it."""
    try:
        member = cls.all_members.get(name)
    except Exception:  # an unresolved base: fall back to the runtime annotation
        member = None
    if member is not None and member.is_attribute and member.annotation is not None:
        return member.annotation
    return None


class EquinoxModuleInit(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        import equinox as eqx

        for cls in _classes(pkg):
            if "__init__" in cls.members:
                continue
            try:
                runtime = getattr(importlib.import_module(cls.module.path), cls.name)
            except (ImportError, AttributeError):
                continue
            if not (isinstance(runtime, type) and issubclass(runtime, eqx.Module)):
                continue
            if runtime.__init__ is object.__init__:
                continue
            signature = inspect.signature(runtime.__init__)
            parameters = [griffe.Parameter("self", kind=griffe.ParameterKind.positional_or_keyword)]
            for p in list(signature.parameters.values())[1:]:
                annotation = _annotation(cls, p.name)
                if annotation is None and p.annotation is not inspect.Parameter.empty:
                    annotation = inspect.formatannotation(p.annotation)
                parameters.append(
                    griffe.Parameter(
                        p.name,
                        annotation=annotation,
                        kind=griffe.ParameterKind(p.kind.description),
                        default=None if p.default is inspect.Parameter.empty else repr(p.default),
                    )
                )
            init = griffe.Function(
                "__init__",
                lineno=cls.lineno,
                endlineno=cls.lineno,
                parent=cls,
                parameters=griffe.Parameters(*parameters),
                returns="None",
            )
            cls.set_member("__init__", init)

"""griffe extension: an Equinox module's signature in the API reference is its `__init__`.

Equinox makes a module's `__init__` from its fields, as `dataclasses` does, but griffe reads
the source and only knows `@dataclass` itself, so `EMA(decay)`, `Sample(k, key=None)` or
`JsonlLogger(path, *, every_process=False)` would be shown without a signature. For each class
of the package without an `__init__` of its own in the source, this takes the parameters of
the class's runtime `__init__` (the one Equinox made), with the annotations as the source
writes them where the field is declared in the package, and gives the class that `__init__`.

The package's plain dataclasses (the Hydra schemas of `eqx_logs.config`) get theirs the same
way, so that a `field(default_factory=...)` shows the default it makes (`stats: list[str] =
['mean', ...]`, not `(lambda: list(DEFAULT_STATS))()`), as griffe's own dataclass support
would show it. And a default that is a private name of the package (`log`'s `value=_MISSING`)
is shown as the `repr` of its value (`MISSING`) where that value has a `repr` of its own.

A docstring whose source holds a line `{policy_options}` (or `{tap_options}`) is filled in at
import time from the one declaration of the policy's options (`eqx_logs/_reduce/_options.py`,
`document_options`), so that `help(eqx_logs.spool)` lists them all. The reference lists them
once, in `eqx_logs.Policy`'s entry, each option with an anchor of its own
(`eqx_logs.Policy(interval)`, as mkdocstrings names a parameter's); the other entries
(`spool`, `tap`, a logger's `spool`, `tap` and `jit`, `eqx_logs.config.policy`) name the
options there, each a link to its entry in `Policy`'s.
"""

import dataclasses
import importlib
import inspect
import re
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


def _functions(obj: griffe.Object):
    for member in obj.members.values():
        if member.is_alias:
            continue
        if member.is_function:
            yield member
        if member.is_module or member.is_class:
            yield from _functions(member)


def _default(runtime: type, p: inspect.Parameter) -> str | None:
    """A parameter's default as the reference shows it: the value a `default_factory`
    makes, or the default's `repr`."""
    if p.default is inspect.Parameter.empty:
        return None
    fields = {f.name: f for f in dataclasses.fields(runtime)}
    field = fields.get(p.name)
    if field is not None and field.default_factory is not dataclasses.MISSING:
        return repr(field.default_factory())
    return repr(p.default)


def _private_defaults(pkg: griffe.Module) -> None:
    """`value=_MISSING` shown as `value=MISSING`: the value's own `repr`."""
    for function in _functions(pkg):
        for p in function.parameters:
            name = p.default.name if isinstance(p.default, griffe.ExprName) else None
            if not (name and name.startswith("_") and name.isidentifier()):
                continue
            try:
                value = getattr(importlib.import_module(function.module.path), name)
            except (ImportError, AttributeError):
                continue
            if type(value).__repr__ is not object.__repr__:
                p.default = repr(value)


_OPTIONS_MARKER = re.compile(r"^([ \t]*)\{(policy|tap)_options\}$", re.M)
# the one entry that lists the options in full
_OPTIONS_OWNER = "eqx_logs.Policy"


def _runtime(obj: griffe.Object) -> Any:
    """The object Python has for `obj` (a function, a class, a method)."""
    value = importlib.import_module(obj.module.path)
    for name in obj.path[len(obj.module.path) + 1 :].split("."):
        value = getattr(value, name)
    return value


def _public(path: str) -> Any:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _options_entries(names, indent: str) -> str:
    """`Policy`'s `**Arguments:**` entries, each with an anchor (`eqx_logs.Policy(reduce)`)."""
    from eqx_logs._reduce._options import options_doc

    text = options_doc(names, indent)
    for name in names:
        item = f"{indent}- `{name}` ("
        anchor = f"{indent}- [](){{#{_OPTIONS_OWNER}({name})}}`{name}` ("
        if text.count(item) != 1:
            raise ValueError(f"{_OPTIONS_OWNER}'s docstring: no single entry for {name!r}.")
        text = text.replace(item, anchor)
    return text


def _options_links(names, indent: str) -> str:
    """The options named, each a link to its entry in `Policy`'s (the sentence before the
    marker names `Policy`: "The policy's options, as for [`eqx_logs.Policy`][]:")."""
    links = ", ".join(f"[`{name}`][{_OPTIONS_OWNER}({name})]" for name in names)
    return f"{indent}{links}.\n"


def _filled_docstrings(pkg: griffe.Module) -> None:
    """The docstrings `document_options` fills in: in full in `Policy`'s, as links in the
    others'. Checked against the docstring Python has (every marker filled in there)."""
    from eqx_logs._reduce._options import OPTIONS, TAP_OPTIONS

    owner = None
    for obj in [*_classes(pkg), *_functions(pkg)]:
        if obj.docstring is None or not _OPTIONS_MARKER.search(obj.docstring.value):
            continue
        runtime = _runtime(obj)
        if _OPTIONS_MARKER.search(inspect.getdoc(runtime)):
            raise ValueError(f"{obj.path}: its docstring's options were not filled in.")
        is_owner = runtime is _public(_OPTIONS_OWNER)  # (its path is the private one)
        fill = _options_entries if is_owner else _options_links
        owner = owner or is_owner

        def entries(m, fill=fill):
            return fill(list(OPTIONS if m[2] == "policy" else TAP_OPTIONS), m[1]).rstrip("\n")

        obj.docstring.value = _OPTIONS_MARKER.sub(entries, obj.docstring.value)
    if not owner:
        raise ValueError(f"{_OPTIONS_OWNER}'s docstring lists no options (`{{policy_options}}`).")


class EquinoxModuleInit(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        import equinox as eqx

        for cls in _classes(pkg):
            # an `__init__` in the source is kept; one griffe made for a dataclass (no line of
            # its own) is made again here
            if "__init__" in cls.members and cls.members["__init__"].lineno:
                continue
            try:
                runtime = getattr(importlib.import_module(cls.module.path), cls.name)
            except (ImportError, AttributeError):
                continue
            if not isinstance(runtime, type):
                continue
            module = issubclass(runtime, eqx.Module)
            if not (module or dataclasses.is_dataclass(runtime)):
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
                        default=_default(runtime, p),
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
            if not module:
                cls.labels.add("dataclass")
        _private_defaults(pkg)
        _filled_docstrings(pkg)

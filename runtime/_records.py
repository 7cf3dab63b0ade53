"""`record`: a frozen, slotted, keyword-only dataclass whose `__init__` only stores its arguments.

What the runtime builds itself from data already checked (events, the messages between actors) needs no
validation on the way: a record costs about what a plain slotted class does (one call, one slot store per
field), a tenth of a pydantic model's `__init__`, and it is one GC-tracked object (a pydantic model is
three: the instance, its `__dict__` and its fields-set). Data from outside is validated where it enters,
by pydantic, which understands these dataclasses (a `TypeAdapter` over a record or a union of records).

Frozen as the dataclass module makes it (assigning a field raises `FrozenInstanceError`), but without its
cost. Dataclasses' frozen `__init__` stores each field through `object.__setattr__`, and a call to the slot's
descriptor is not much cheaper (about 45 ns a field): the frozen class's own `__setattr__` keeps Python
from storing a slot at its plain speed (about 10 ns). So a record is built as its *builder*: a subclass
that adds no slot and keeps object's `__setattr__`, which an instance is while its fields are stored, then
turned into the record by assigning its `__class__` (the two have the same layout; about 60 ns). A
10-field record made by a `maker` costs 194 ns so, against 586 through the descriptors; through `__init__`
(keywords: `type.__call__` builds a dict) 658 against 924. Records with few fields, for which the swap
would cost more than it saves, store through the descriptors. No one sees a builder: it exists only
between a record's allocation and the end of its `__init__` or `maker`. Everything else (`__eq__`,
`__hash__`, `__repr__`, `__match_args__`, `dataclasses.fields/replace/asdict`, pickling) is the dataclass
module's own.

A layer of its own at the bottom, as `errors` is: it imports nothing of ours, and both the kernel (its
messages) and the loop (its events) are built on it.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar, dataclass_transform

R = TypeVar("R")
P = ParamSpec("P")

_MISSING: Any = object()
"""The default of a parameter whose field has a `default_factory`: the factory runs when it is seen."""


@dataclass_transform(kw_only_default=True, frozen_default=True, field_specifiers=(dataclasses.field,))
def record(cls: type[R]) -> type[R]:
    """Make `cls` a frozen, slotted, keyword-only dataclass with a storing-only `__init__`.

    Fields are declared as on any dataclass (`name: type = default`, `dataclasses.field(default_factory=...)`);
    a base that declares no field of its own must declare `__slots__ = ()`, or every instance gets a `__dict__`.
    """
    made: type[R] = dataclasses.dataclass(frozen=True, slots=True, kw_only=True)(cls)
    made.__init__ = _storing_init(made)  # type: ignore[method-assign]
    return made


_set_class = object.__dict__["__class__"].__set__
"""Assigns an object's class past a frozen `__setattr__` (what `object.__setattr__(obj, "__class__", c)` does)."""

INIT_BUILDER_FIELDS = 4
"""`__init__` builds through the builder from this many fields (two class swaps: below it they cost more)."""
MAKER_BUILDER_FIELDS = 3
"""A `maker` builds through the builder from this many fields (one class swap)."""


def _builder(cls: type[Any]) -> type[Any]:
    """The subclass of `cls` an instance is while its fields are stored: no slot of its own, object's `__setattr__`."""
    builder = cls.__dict__.get("_record_builder")
    if builder is None:
        namespace = {
            "__slots__": (),
            "__setattr__": object.__setattr__,
            "__delattr__": object.__delattr__,
            "__module__": cls.__module__,
            "__qualname__": f"{cls.__qualname__}.<builder>",
        }
        builder = type(f"{cls.__name__}Builder", (cls,), namespace)
        type.__setattr__(cls, "_record_builder", builder)  # its own: a subclass record has another
    return builder


def maker(cls: type[R], *given: str) -> Callable[..., R]:
    """A function `make(*values)` building a `cls` from the values of the `given` fields, in order,
    every other field at its default: for the hottest construction sites.

    Calling a class runs `type.__call__`, which hands keyword arguments to a Python `__init__` as a
    dict built per call; this makes the instance and stores its slots directly, a third cheaper
    (measured on `StreamEvent`: 230 against 345 ns). Every field not given needs a plain default.
    """
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    unknown = set(given) - {field.name for field in fields}
    if unknown:
        msg = f"{cls.__qualname__} has no field {sorted(unknown)}"
        raise TypeError(msg)
    namespace: dict[str, Any] = {}
    values: list[tuple[str, str]] = []
    for field in fields:
        name = field.name
        if name in given:
            values.append((name, name))
        elif field.default is not dataclasses.MISSING:
            namespace[f"_default_{name}"] = field.default
            values.append((name, f"_default_{name}"))
        else:
            msg = f"{cls.__qualname__}.{name} has no plain default: give it to maker()"
            raise TypeError(msg)
    make: Callable[..., R] = _make_function(cls, namespace, ", ".join(given), values, f"maker({cls.__qualname__})")
    return make


def replacer(cls: type[R]) -> Callable[..., R]:
    """A function `replace(old, **changes)` that does what `dataclasses.replace` does for a record of `cls`:
    a new one with `old`'s fields, but those in `changes`. For a record remade once per loop iteration.

    `dataclasses.replace` reads every field into a dict and calls the class (`type.__call__`, then
    `__init__`'s keywords); this stores each slot at once, as `maker` does. Unknown fields raise TypeError.
    """
    fields = [field.name for field in dataclasses.fields(cls)]  # type: ignore[arg-type]
    namespace: dict[str, Any] = {"_new": object.__new__, "_cls": cls, "_builder": _builder(cls), "_names": set(fields)}
    body = [f"    self.{name} = changes.get({name!r}, old.{name}) if changes else old.{name}" for name in fields]
    source = (
        "def replace(old, /, **changes):\n"
        "    if not changes.keys() <= _names:\n"
        "        raise TypeError(f'{_cls.__qualname__} has no field {sorted(changes.keys() - _names)}')\n"
        "    self = _new(_builder)\n" + "\n".join(body) + "\n    self.__class__ = _cls\n    return self\n"
    )
    exec(source, namespace)  # generated from the class's own field names, as `maker` is
    replace: Callable[..., R] = namespace["replace"]
    replace.__qualname__ = f"replacer({cls.__qualname__})"
    replace.__module__ = cls.__module__
    return replace


def keyword_maker(cls: Callable[P, R]) -> Callable[P, R]:
    """`cls(**fields)` as a plain function, with the same keywords, defaults and types: for the construction
    sites that run per call, per block or per tool.

    Calling a class builds a dict of its keywords (`type.__call__`) for `__init__`; a function binds them
    as they come. A 10-field record: 311 ns against 658.
    """
    record_class: type[Any] = cls  # type: ignore[assignment]  # a record class, as `record` made it
    namespace, params, values = _field_code(record_class)
    signature = f"*, {', '.join(params)}" if params else ""
    make: Callable[P, R] = _make_function(
        record_class, namespace, signature, values, f"keyword_maker({record_class.__qualname__})"
    )
    return make


def _make_function(
    cls: type[Any], namespace: dict[str, Any], signature: str, values: list[tuple[str, str]], qualname: str
) -> Any:
    """`def make(signature)` building a `cls` whose fields get `values` (`(field, expression)`, in field
    order): as its builder where it has enough fields, else through the slot descriptors."""
    built = len(values) >= MAKER_BUILDER_FIELDS
    namespace.update(_new=object.__new__, _cls=cls, _builder=_builder(cls) if built else cls)
    if built:
        body = [f"    self.{name} = {value}" for name, value in values] + ["    self.__class__ = _cls"]
    else:
        body = [f"    _set_{name}(self, {value})" for name, value in values]
        namespace.update({f"_set_{name}": getattr(cls, name).__set__ for name, _ in values})
    source = f"def make({signature}):\n    self = _new(_builder)\n" + "\n".join(body) + "\n    return self\n"
    exec(source, namespace)  # generated from the class's own field names, as `_storing_init` is
    make = namespace["make"]
    make.__qualname__ = qualname
    make.__module__ = cls.__module__
    return make


def _field_code(cls: type[Any]) -> tuple[dict[str, Any], list[str], list[tuple[str, str]]]:
    """What generated code needs of `cls`'s fields: its namespace (descriptor setters, defaults, factories),
    the keyword parameters (`name=default`) and each field's value expression, in field order."""
    if hasattr(cls, "__post_init__"):
        msg = f"{cls.__qualname__}: a record has no __post_init__ (it stores its arguments, nothing else)"
        raise TypeError(msg)
    namespace: dict[str, Any] = {"_MISSING": _MISSING}
    params: list[str] = []
    values: list[tuple[str, str]] = []
    for field in dataclasses.fields(cls):
        name = field.name
        slot = getattr(cls, name)
        if not field.init or not isinstance(slot, types.MemberDescriptorType):
            msg = f"{cls.__qualname__}.{name}: a record's fields are slots set by __init__"
            raise TypeError(msg)
        namespace[f"_set_{name}"] = slot.__set__
        value = name
        if field.default is not dataclasses.MISSING:
            namespace[f"_default_{name}"] = field.default
            params.append(f"{name}=_default_{name}")
        elif field.default_factory is not dataclasses.MISSING:
            namespace[f"_factory_{name}"] = field.default_factory
            params.append(f"{name}=_MISSING")
            value = f"_factory_{name}() if {name} is _MISSING else {name}"
        else:
            params.append(name)
        values.append((name, value))
    return namespace, params, values


def _storing_init(cls: type[Any]) -> Any:
    """The `__init__` the dataclass module would write for `cls`, storing as the module's docstring says.

    An instance of a subclass that is not a record itself (whose layout may differ from the builder's)
    stores through the slot descriptors."""
    namespace, params, values = _field_code(cls)
    body = [f"    _set_{name}(self, {value})" for name, value in values]
    if len(values) >= INIT_BUILDER_FIELDS:
        namespace.update(_cls=cls, _builder=_builder(cls), _set_class=_set_class)
        built = ["    if self.__class__ is _cls:", "        _set_class(self, _builder)"]
        built += [f"        self.{name} = {value}" for name, value in values]
        built += ["        self.__class__ = _cls", "        return"]
        body = built + body
    signature = f"self, *, {', '.join(params)}" if params else "self"
    source = f"def __init__({signature}) -> None:\n" + ("\n".join(body) or "    pass") + "\n"
    exec(source, namespace)  # generated from the class's own field names, as dataclasses does
    init = namespace["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__module__ = cls.__module__
    return init

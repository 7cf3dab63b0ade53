"""`EMPTY_LIST`, `EMPTY_DICT` and `EMPTY_SET`: one shared, unchangeable empty list, dict and set, for the
runtime's own defaults.

An object the runtime keeps for as long as a loop is in flight (a turn, a query's run, the assembler of a
response, a loop's sidechains, a group's children) would otherwise hold a fresh empty container per field,
and every one of them is a GC-tracked object the collector walks and promotes while the loop lives
(docs/collector.md). These are the defaults instead: a `list`, a `dict` and a `set` (so `isinstance`, `==`,
iteration, `len`, JSON and pydantic's serializers treat them as the empty containers they are) that refuse
to change, since every default shares them. Copies (`copy`, `deepcopy`, pickling, Ray's cloudpickle) give
the same shared object back. A field that is written to later starts as one of these where most instances
never write to it, and is replaced by a container of its own at its first write (`field is EMPTY_LIST`:
made now).

Inside the runtime only: what a user builds or holds (`QueryOptions`, a `QueryHandle`'s `transitions`,
every class `queryloop` exports) has plain defaults, a fresh container per instance, which the user may
change (docs/design.md, "The hot path", says what each use here saves).

A layer of its own at the bottom, as `_records` is: it imports nothing of ours.
"""

from __future__ import annotations

from typing import Any, ClassVar, NoReturn, Self


def _refuse(self: object, *_args: Any, **_kwargs: Any) -> NoReturn:
    msg = f"{type(self).__name__}: a shared empty default cannot change; give the field a container of your own"
    raise TypeError(msg)


class _Shared:
    """Copies of a shared empty give it back; pickling refers to it by its name in this module."""

    __slots__ = ()
    _name: ClassVar[str]

    def __copy__(self) -> Self:
        return self

    def __deepcopy__(self, _memo: Any) -> Self:
        return self

    def __reduce__(self) -> str:
        return self._name


class FrozenEmptyList(_Shared, list[Any]):
    """The empty list every list default shares (`EMPTY_LIST`): reads as `[]`, refuses every change."""

    __slots__ = ()
    _name = "EMPTY_LIST"

    append = extend = insert = remove = pop = clear = sort = reverse = _refuse
    __setitem__ = __delitem__ = __iadd__ = __imul__ = _refuse


class FrozenEmptyDict(_Shared, dict[Any, Any]):
    """The empty dict every dict default shares (`EMPTY_DICT`): reads as `{}`, refuses every change."""

    __slots__ = ()
    _name = "EMPTY_DICT"

    __setitem__ = __delitem__ = __ior__ = _refuse
    update = setdefault = pop = popitem = clear = _refuse


class FrozenEmptySet(_Shared, set[Any]):
    """The empty set every set default shares (`EMPTY_SET`): reads as `set()`, refuses every change."""

    __slots__ = ()
    _name = "EMPTY_SET"

    add = discard = remove = pop = clear = update = _refuse
    difference_update = intersection_update = symmetric_difference_update = _refuse
    __ior__ = __iand__ = __isub__ = __ixor__ = _refuse

    def __repr__(self) -> str:
        return "set()"


EMPTY_LIST = FrozenEmptyList()
EMPTY_DICT = FrozenEmptyDict()
EMPTY_SET = FrozenEmptySet()


def empty_list() -> Any:
    """`field(default_factory=empty_list)` of a runtime-internal dataclass: the shared `EMPTY_LIST` (typed
    `Any`, to fit any `list[...]` field). Never the default of a model a user builds or holds."""
    return EMPTY_LIST


def empty_set() -> Any:
    """`field(default_factory=empty_set)` of a runtime-internal dataclass: the shared `EMPTY_SET`."""
    return EMPTY_SET

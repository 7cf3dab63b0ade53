"""`EMPTY_LIST` and `EMPTY_DICT`: one shared, unchangeable empty list and dict, for defaults.

A model whose list and dict fields default to `Field(default_factory=list)` gets a fresh empty
container per instance, and every one of them is a GC-tracked object for as long as the instance
lives. `QueryOptions` has ten such fields and a session holds its options from open to close: ten
objects per session, in flight for every loop a host runs (what the collector walks and promotes;
docs/collector.md). These two are the defaults instead: a `list` and a `dict` (so `isinstance`, `==`,
iteration, `len`, JSON and pydantic's serializers treat them as the empty containers they are) that
refuse to change, since every default shares them. Copies (`copy`, `deepcopy`, pickling, Ray's
cloudpickle) give the same shared object back.

A layer of its own at the bottom, as `_records` is: it imports nothing of ours.
"""

from __future__ import annotations

from typing import Any, NoReturn


def _refuse(self: object, *_args: Any, **_kwargs: Any) -> NoReturn:
    msg = f"{type(self).__name__}: a shared empty default cannot change; give the field a list or dict of your own"
    raise TypeError(msg)


class FrozenEmptyList(list[Any]):
    """The empty list every list default shares (`EMPTY_LIST`): reads as `[]`, refuses every change."""

    __slots__ = ()

    append = extend = insert = remove = pop = clear = sort = reverse = _refuse
    __setitem__ = __delitem__ = __iadd__ = __imul__ = _refuse

    def __copy__(self) -> FrozenEmptyList:
        return self

    def __deepcopy__(self, _memo: Any) -> FrozenEmptyList:
        return self

    def __reduce__(self) -> str:
        return "EMPTY_LIST"  # pickled by name: unpickled as this module's one instance

    def __repr__(self) -> str:
        return "[]"


class FrozenEmptyDict(dict[Any, Any]):
    """The empty dict every dict default shares (`EMPTY_DICT`): reads as `{}`, refuses every change."""

    __slots__ = ()

    __setitem__ = __delitem__ = __ior__ = _refuse
    update = setdefault = pop = popitem = clear = _refuse

    def __copy__(self) -> FrozenEmptyDict:
        return self

    def __deepcopy__(self, _memo: Any) -> FrozenEmptyDict:
        return self

    def __reduce__(self) -> str:
        return "EMPTY_DICT"

    def __repr__(self) -> str:
        return "{}"


EMPTY_LIST = FrozenEmptyList()
EMPTY_DICT = FrozenEmptyDict()


def empty_list() -> Any:
    """`Field(default_factory=empty_list)`: the shared `EMPTY_LIST` (typed `Any`, to fit any `list[...]` field)."""
    return EMPTY_LIST


def empty_dict() -> Any:
    """`Field(default_factory=empty_dict)`: the shared `EMPTY_DICT`."""
    return EMPTY_DICT

"""What an instrumented chat-template render observes, so that a later render of a longer
conversation can start in the middle of the message loop (router.tokenize.local_template).

Two things make a message's rendered text depend on more than the message itself:

* **State carried from message to message** in Jinja ``namespace`` objects (Kimi-K3's
  template counts images and tool results across the conversation, and keeps the last
  assistant message's tool calls for the tool results that follow). Jinja's own variables
  cannot carry anything from one loop iteration to the next; namespaces can, and so the render
  records them (:func:`freeze`) at the start of every message, and a later render restores
  them (:func:`thaw_into`) where it starts.
* **Reads of other messages** (``messages[loop.index0 - 1]``, a scan of the tool results that
  follow). :class:`TrackedMessages` is what the template sees as ``messages``: it notes the
  first message whose text depended on *where the conversation ends* (its length, its last
  message, a scan that ran off the end). That message and every later one must be rendered
  again when the conversation grows; the ones before it are final.

Only the namespaces created before the message loop are state (namespaces made inside the
loop are per message unless stored in one of those, which :func:`freeze` follows).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from types import BuiltinFunctionType, FunctionType, MethodType, ModuleType
from typing import Any

from jinja2.runtime import Macro, Undefined
from jinja2.utils import Namespace

# Namespaces keep their attributes in a name-mangled dict (jinja2.utils.Namespace).
_ATTRS = "_Namespace__attrs"
# Values kept by reference in a snapshot: immutable, or (functions, macros) without state.
_SHARED = (str, int, float, bytes, type(None), Undefined, Macro)


def _attrs_of(ns: Namespace) -> dict[str, Any]:
    attrs: dict[str, Any] = object.__getattribute__(ns, _ATTRS)
    return attrs


class NotConversation(TypeError):
    """The template's message loop does not run over the conversation (router renders the
    template whole)."""


@dataclass(slots=True, frozen=True)
class _ConversationView:
    """A head variable that is the conversation or a slice of it from ``start``: equal in
    every render of a conversation, whatever its length (each render makes its own)."""

    start: int
    stop: int | None


class Unfreezable(Exception):
    """State holds an object whose state a snapshot can not capture (a ``cycler``, a loop
    object, a generator, the tracked ``messages``): resume before it came to be."""


class _Frozen:
    """A namespace's attributes at one moment. Within one snapshot a namespace freezes to
    one object, so a namespace reachable from two places comes back as one (and cycles
    terminate)."""

    __slots__ = ("attrs",)

    def __init__(self) -> None:
        self.attrs: tuple[tuple[str, Any], ...] = ()


class Freezer:
    """Takes snapshots during one render. Lists, tuples and dicts can not change under the
    immutable sandbox, so one that holds no namespace is checked once per render, not at
    every message (state often keeps a list that grows by concatenation)."""

    __slots__ = ("_pure",)

    def __init__(self) -> None:
        self._pure: dict[int, Any] = {}  # id -> the container (kept alive: ids stay unique)

    def snapshot(self, values: Any) -> Any:
        """``values`` with every namespace replaced by a :class:`_Frozen`; raises
        Unfreezable."""
        return self._value(values, {})

    def _value(self, value: Any, memo: dict[int, _Frozen]) -> Any:
        kind = type(value)
        if kind is bool or isinstance(value, _SHARED) or kind is _ConversationView:
            return value
        if kind is FunctionType or kind is BuiltinFunctionType or kind is MethodType:
            bound = getattr(value, "__self__", None)
            if bound is None or isinstance(bound, ModuleType):
                return value  # a function: what it returns is the analysis's concern
            self._value(bound, memo)  # a method of something a snapshot can hold
            return value
        if kind is Namespace:
            frozen = memo.get(id(value))
            if frozen is None:
                frozen = memo[id(value)] = _Frozen()
                frozen.attrs = tuple((k, self._value(v, memo)) for k, v in _attrs_of(value).items())
            return frozen
        if kind is list or kind is tuple or kind is dict:
            if self._pure.get(id(value)) is value:
                return value
            items = value.values() if kind is dict else value
            before = len(memo)
            frozen_items = [self._value(v, memo) for v in items]
            if len(memo) == before and all(
                f is v for f, v in zip(frozen_items, items, strict=True)
            ):
                self._pure[id(value)] = value
                return value
            if kind is dict:
                return dict(zip(value.keys(), frozen_items, strict=True))
            return frozen_items if kind is list else tuple(frozen_items)
        raise Unfreezable(type(value).__name__)


def restore(namespaces: Sequence[Namespace], snapshot: Sequence[_Frozen]) -> None:
    """Make each of ``namespaces`` hold what it held when ``snapshot`` was taken; nested
    namespaces are fresh objects (the snapshot is never changed), shared where they were
    shared, and a head namespace nested in another is that namespace itself."""
    memo: dict[int, Namespace] = {id(f): ns for ns, f in zip(namespaces, snapshot, strict=True)}
    for ns, frozen in zip(namespaces, snapshot, strict=True):
        attrs = _attrs_of(ns)
        attrs.clear()
        attrs.update((k, _thaw(v, memo)) for k, v in frozen.attrs)


def _thaw(value: Any, memo: dict[int, Namespace]) -> Any:
    kind = type(value)
    if kind is _Frozen:
        ns = memo.get(id(value))
        if ns is None:
            ns = memo[id(value)] = Namespace()
            _attrs_of(ns).update((k, _thaw(v, memo)) for k, v in value.attrs)
        return ns
    if kind is list or kind is tuple or kind is dict:
        items = value.values() if kind is dict else value
        thawed = [_thaw(v, memo) for v in items]
        if all(t is v for t, v in zip(thawed, items, strict=True)):
            return value
        if kind is dict:
            return dict(zip(value.keys(), thawed, strict=True))
        return thawed if kind is list else tuple(thawed)
    return value


def same_value(a: Any, b: Any, seen: set[tuple[int, int]] | None = None) -> bool:
    """``a`` and ``b`` would render identically: equal *and* of the same types and key order
    throughout (Python's ``==`` holds for ``1``, ``1.0`` and ``True``, and for dicts in
    another key order, which ``tojson`` renders differently). Parsed JSON (cached messages)
    and snapshots (namespaces, cycles included) alike."""
    if a is b:
        return True
    kind = type(a)
    if kind is not type(b):
        return False
    if kind is str:
        return bool(a == b)
    if kind is dict:
        if len(a) != len(b):
            return False
        for (ka, va), (kb, vb) in zip(a.items(), b.items(), strict=True):
            if ka != kb or not (
                va == vb if type(va) is str is type(vb) else same_value(va, vb, seen)
            ):
                return False
        return True
    if kind is list or kind is tuple:
        return len(a) == len(b) and all(same_value(x, y, seen) for x, y in zip(a, b, strict=True))
    if kind is _Frozen:
        seen = set() if seen is None else seen
        if (id(a), id(b)) in seen:
            return True  # a cycle, compared on the way in
        seen.add((id(a), id(b)))
        return same_value(a.attrs, b.attrs, seen)
    if kind is float:
        return repr(a) == repr(b)  # -0.0 and 0.0 render differently; NaN equals NaN
    try:
        return bool(a == b)
    except Exception:  # an object that can not be compared: not the same
        return False


class StateMismatch(Exception):
    """A render could not restore the state it was given (the template made a different set
    of namespaces before its message loop): the caller renders the conversation whole."""


class _Uncomparable:
    """What the head left, when a snapshot can not hold it: equal to nothing, so a render
    that would resume from it starts from the first message instead."""

    __slots__ = ()


class Recorder:
    """One instrumented render's observations (one per render; not shared between threads).

    ``index`` is the message being rendered (-1 before the loop, ``None`` after it). The
    render's resume point is the latest message at whose start the state was captured, up
    to the first message whose text depended on where the conversation ends or whose
    starting state could not be captured (:class:`Unfreezable`). ``head_state`` is what the
    statements before the loop left (their variables and namespaces, frozen): a render that
    resumes must find the same."""

    __slots__ = (
        "expect_head",
        "freezer",
        "good",
        "head_reads_end",
        "head_state",
        "index",
        "loop_length",
        "namespaces",
        "resume",
        "state",
        "stopped",
    )

    def __init__(
        self, start: int, state: tuple[_Frozen, ...] | None, expect_head: Any = None
    ) -> None:
        self.index: int | None = -1
        self.namespaces: list[Namespace] = []  # made before the loop, in order
        self.state = state  # to restore at the loop's start (None: render from message 0)
        self.expect_head = expect_head  # the head state the resumed render had
        self.head_state: Any = None
        self.resume = start  # where this render's loop starts
        self.freezer = Freezer()
        # (message, state at its start) of the latest capture; a resumed render starts
        # from a captured state (None: a render from message 0 has captured nothing yet)
        self.good: tuple[int, tuple[Any, ...]] | None = (start, state) if state else None
        self.stopped = False  # the resume point is final
        self.head_reads_end = False  # the statements before the loop read the whole list
        self.loop_length = 0  # how many messages the message loop iterates in all

    def rows(self, source: Any, start: int) -> Sequence[Any]:
        """What the message loop iterates from its ``start``-th item: the loop is over
        ``messages`` or a slice of it from a fixed start (a plain list: the loop's own
        iteration to the end depends on nothing). Anything else: :class:`NotConversation`."""
        drop = 0  # messages at the end the loop leaves out (``messages[:-1]``)
        if type(source) is TrackedMessages:
            items, first = source._items, 0
        elif type(source) is _View and (source._stop is None or source._stop < 0):
            items, first = source._base._items, source._start
            drop = -source._stop if source._stop is not None else 0
        else:
            raise NotConversation(f"the message loop runs over a {type(source).__name__}")
        end = max(len(items) - drop, first)
        self.loop_length = end - first
        return items[first + start : end]  # a new list: the slice

    @property
    def resumable(self) -> bool:
        """Whether a later render can ever resume from this one (what the head left could
        be captured)."""
        return not isinstance(self.head_state, _Uncomparable)

    def namespace(self, *args: Any, **kwargs: Any) -> Namespace:
        """The template's ``namespace()``: namespaces made before the loop are recorded."""
        ns = Namespace(*args, **kwargs)
        if self.index == -1:
            self.namespaces.append(ns)
        return ns

    def opened(self) -> None:
        """The text being rendered depends on where the conversation ends."""
        index = self.index
        if index is None:
            return  # the tail is rendered every time anyway
        if index < 0:
            self.head_reads_end = True  # what the head leaves is compared on resuming
            return
        self.stopped = True

    def _capture(self, index: int) -> None:
        if self.stopped:
            return
        try:
            self.good = (index, self.freezer.snapshot(tuple(self.namespaces)))
        except Unfreezable:
            self.stopped = True  # resume where the state was still captured

    def loop_start(self, head: dict[str, Any]) -> None:
        """Before the first message of this render: check that the statements before the
        loop left what they left in the render being resumed (``head``: their variables),
        and restore the state this render was given."""
        try:
            variables = {
                k: _ConversationView(v._start, v._stop)
                if type(v) is _View
                else _ConversationView(0, None)
                if type(v) is TrackedMessages
                else v
                for k, v in head.items()
            }
            self.head_state = self.freezer.snapshot((variables, tuple(self.namespaces)))
        except Unfreezable:
            self.head_state = _Uncomparable()
        if self.state is not None:
            if not same_value(self.head_state, self.expect_head):
                raise StateMismatch("the statements before the loop left other values")
            if len(self.state) != len(self.namespaces):
                raise StateMismatch("the template made other namespaces before its loop")
            restore(self.namespaces, self.state)
        self.index = self.resume - 1

    def message_start(self) -> None:
        """At the start of each message: note its index and the state it starts from."""
        assert self.index is not None
        self.index += 1
        if self.index > self.resume or self.good is None:
            self._capture(self.index)

    def loop_end(self) -> tuple[int, tuple[Any, ...]] | None:
        """After the last message: where (and from what state) a render of a longer
        conversation may start; None: nowhere (nothing could be captured)."""
        if self.index is not None:
            self._capture(self.index + 1)
        self.index = None
        return self.good


class ListLike(Sequence[Any]):
    """Printed, compared and concatenated the way the plain list would be (all of it: that
    depends on where it ends)."""

    __slots__ = ()
    __hash__ = None  # type: ignore[assignment]

    def as_list(self) -> list[Any]:
        raise NotImplementedError

    def __repr__(self) -> str:
        return repr(self.as_list())

    def __eq__(self, other: object) -> bool:
        return bool(self.as_list() == plain(other))

    def __add__(self, other: Any) -> Any:
        return self.as_list() + plain(other)

    def __radd__(self, other: Any) -> Any:
        return plain(other) + self.as_list()


class TrackedMessages(ListLike):
    """``messages`` as the instrumented template sees it: the same items, and every access
    whose answer depends on where the list ends is reported to the :class:`Recorder`."""

    __slots__ = ("_items", "_recorder")

    def __init__(self, items: Sequence[Any], recorder: Recorder) -> None:
        self._items = items
        self._recorder = recorder

    def __len__(self) -> int:
        self._recorder.opened()
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)  # a cached prefix is never empty: it stays true

    def __getitem__(self, key: Any) -> Any:
        items = self._items
        if isinstance(key, slice):
            bounds = _bounds(key, self._recorder)
            if bounds is None:  # depends on the length: a plain slice
                return items[key]
            return _View(self, *bounds)
        if not isinstance(key, int) or key < 0 or key >= len(items):
            self._recorder.opened()  # from the end, or past it: depends on the length
        return items[key]

    def __iter__(self) -> Iterator[Any]:
        yield from self._items
        self._recorder.opened()

    def __reversed__(self) -> Iterator[Any]:
        self._recorder.opened()
        backwards: Iterator[Any] = reversed(self._items)
        return backwards

    def __contains__(self, value: object) -> bool:
        self._recorder.opened()
        return value in self._items

    def as_list(self) -> list[Any]:
        self._recorder.opened()
        return list(self._items)


def plain(value: Any) -> Any:
    """A tracked list or view as the plain list it stands for (other values unchanged)."""
    return value.as_list() if isinstance(value, ListLike) else value


def _bounds(key: slice, recorder: Recorder) -> tuple[int, int | None] | None:
    """(start, stop) of a slice with step 1 and a start from the start (``stop`` None: to
    the end; negative: that many before the end, as ``messages[:-1]``, which depends on
    the length and is reported). Anything else (a negative start, other steps, such as
    ``messages[::-1]``) is reported and gives None (the caller slices plainly)."""
    start, stop, step = key.start, key.stop, key.step
    if (
        (step is not None and step != 1)
        or (start is not None and (type(start) is not int or start < 0))
        or (stop is not None and type(stop) is not int)
    ):
        recorder.opened()
        return None
    if stop is not None and stop < 0:
        recorder.opened()  # which messages it holds depends on where the list ends
    return start or 0, stop


class _View(ListLike):
    """``messages[start:stop]``, tracked like the whole list. ``stop`` None: to the end;
    negative: that many messages before the end (``messages[:-1]``)."""

    __slots__ = ("_base", "_start", "_stop")

    def __init__(self, base: TrackedMessages, start: int, stop: int | None) -> None:
        self._base = base
        self._start = start
        self._stop = stop

    def _end(self) -> int:
        """The view's end; reports when it is the list's end rather than ``stop``."""
        length = len(self._base._items)
        stop = self._stop
        if stop is None or stop > length:
            self._base._recorder.opened()
            return length
        if stop < 0:
            self._base._recorder.opened()  # relative to the end
            return max(length + stop, 0)
        return stop

    def _stop_now(self) -> int:
        """Where the view ends in this render (nothing reported)."""
        length = len(self._base._items)
        stop = self._stop
        if stop is None:
            return length
        return max(length + stop, 0) if stop < 0 else min(stop, length)

    def __len__(self) -> int:
        return max(self._end() - self._start, 0)

    def _sliced(self, lo: int, hi: int | None) -> _View | None:
        """``self[lo:hi]`` as a view of the conversation (``hi`` as :func:`_bounds` gives
        it); None when that would need two kinds of stop at once (one from the start, one
        from the end)."""
        start, stop = self._start + lo, self._stop
        if hi is None:
            return _View(self._base, start, stop)
        if stop is None:  # open-ended: the slice's stop, from the start or the end
            return _View(self._base, start, self._start + hi if hi >= 0 else hi)
        if hi >= 0 and stop >= 0:
            return _View(self._base, start, min(self._start + hi, stop))
        return None

    def __bool__(self) -> bool:
        if self._stop_now() <= self._start:
            self._base._recorder.opened()  # empty now, perhaps not when the list grows
            return False
        return True  # a longer list keeps it non-empty (an end-relative stop grows too)

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, slice):
            bounds = _bounds(key, self._base._recorder)
            view = None if bounds is None else self._sliced(*bounds)
            if view is None:  # a slice a view can not express: plain, and end-dependent
                self._base._recorder.opened()
                return list(self)[key]
            return view
        if not isinstance(key, int) or key < 0:
            self._base._recorder.opened()
            return list(self)[key]
        at = self._start + key
        stop = self._stop
        if stop is not None and stop < 0 and at >= len(self._base._items) + stop:
            self._base._recorder.opened()  # in range once the list is longer
            raise IndexError(key)
        if stop is not None and stop >= 0 and at >= stop:
            raise IndexError(key)
        return self._base[at]  # past the list's end: reported there

    def __iter__(self) -> Iterator[Any]:
        items = self._base._items
        stop = self._stop
        i = self._start
        if stop is not None and stop < 0:
            while i < len(items) + stop:
                yield items[i]
                i += 1
            self._base._recorder.opened()  # ended where the conversation ends, less -stop
            return
        while stop is None or i < stop:
            if i >= len(items):
                self._base._recorder.opened()  # ran off the end of the conversation
                return
            yield items[i]
            i += 1

    def __reversed__(self) -> Iterator[Any]:
        backwards: Iterator[Any] = reversed(list(self))
        return backwards

    def __contains__(self, value: object) -> bool:
        return any(v is value or v == value for v in self)

    def as_list(self) -> list[Any]:
        return list(self)

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
from typing import Any

from jinja2.utils import Namespace

# Namespaces keep their attributes in a name-mangled dict (jinja2.utils.Namespace).
_ATTRS = "_Namespace__attrs"


def _attrs(ns: Namespace) -> dict[str, Any]:
    attrs: dict[str, Any] = object.__getattribute__(ns, _ATTRS)
    return attrs


@dataclass(slots=True, frozen=True)
class _Frozen:
    """A namespace's attributes at one moment (nested namespaces frozen too)."""

    attrs: tuple[tuple[str, Any], ...]


def _holds_namespace(value: Any) -> bool:
    kind = type(value)
    if kind is Namespace:
        return True
    if kind is list or kind is tuple:
        return any(_holds_namespace(v) for v in value)
    if kind is dict:
        return any(_holds_namespace(v) for v in value.values())
    return False


def freeze(value: Any) -> Any:
    """``value`` with every namespace in it replaced by a snapshot of its attributes. Other
    values are shared: the immutable sandbox lets a template change only namespaces."""
    kind = type(value)
    if kind is Namespace:
        return _Frozen(tuple((k, freeze(v)) for k, v in _attrs(value).items()))
    if (kind is list or kind is tuple or kind is dict) and _holds_namespace(value):
        if kind is dict:
            return {k: freeze(v) for k, v in value.items()}
        frozen = [freeze(v) for v in value]
        return frozen if kind is list else tuple(frozen)
    return value


def thaw(value: Any) -> Any:
    """A fresh live copy of a frozen value (the snapshot itself is never changed)."""
    kind = type(value)
    if kind is _Frozen:
        return Namespace({k: thaw(v) for k, v in value.attrs})
    if (kind is list or kind is tuple or kind is dict) and _holds_frozen(value):
        if kind is dict:
            return {k: thaw(v) for k, v in value.items()}
        thawed = [thaw(v) for v in value]
        return thawed if kind is list else tuple(thawed)
    return value


def _holds_frozen(value: Any) -> bool:
    kind = type(value)
    if kind is _Frozen:
        return True
    if kind is list or kind is tuple:
        return any(_holds_frozen(v) for v in value)
    if kind is dict:
        return any(_holds_frozen(v) for v in value.values())
    return False


def thaw_into(ns: Namespace, frozen: _Frozen) -> None:
    """Make ``ns`` hold what it held when ``frozen`` was taken."""
    attrs = _attrs(ns)
    attrs.clear()
    attrs.update((k, thaw(v)) for k, v in frozen.attrs)


def same_value(a: Any, b: Any) -> bool:
    """``a`` and ``b`` would render the same: equal and of the same types throughout (``1``,
    ``1.0`` and ``True`` are equal in Python and render differently)."""
    if a is b:
        return True
    kind = type(a)
    if kind is not type(b):
        return False
    if kind is _Frozen:
        return same_value(a.attrs, b.attrs)
    if kind is list or kind is tuple:
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b, strict=True))
    if kind is dict:
        return len(a) == len(b) and all(
            ka == kb and same_value(va, vb)
            for (ka, va), (kb, vb) in zip(a.items(), b.items(), strict=True)
        )
    if kind is float:
        return repr(a) == repr(b)
    try:
        return bool(a == b)
    except Exception:  # an object that can not be compared: not the same
        return False


class StateMismatch(Exception):
    """A render could not restore the state it was given (the template made a different set
    of namespaces before its message loop): the caller renders the conversation whole."""


class Recorder:
    """One instrumented render's observations (one per render; not shared between threads).

    ``index`` is the message being rendered (-1 before the loop, ``None`` after it);
    ``first_open`` the first message whose text depended on where the conversation ends
    (``None``: none did); ``head_state`` what the statements before the loop left (their
    variables and namespaces, frozen): a render that resumes must find the same."""

    __slots__ = (
        "expect_head",
        "first_open",
        "head_state",
        "index",
        "latest",
        "namespaces",
        "resume",
        "state",
    )

    def __init__(
        self, start: int, state: tuple[_Frozen, ...] | None, expect_head: Any = None
    ) -> None:
        self.index: int | None = -1
        self.first_open: int | None = None
        self.namespaces: list[Namespace] = []  # made before the loop, in order
        self.state = state  # to restore at the loop's start (None: render from message 0)
        self.expect_head = expect_head  # the head state the resumed render had
        self.head_state: Any = None
        self.resume = start  # where this render's loop starts
        self.latest: tuple[Any, ...] = ()  # the namespaces at the current message's start

    def namespace(self, *args: Any, **kwargs: Any) -> Namespace:
        """The template's ``namespace()``: namespaces made before the loop are recorded."""
        ns = Namespace(*args, **kwargs)
        if self.index == -1:
            self.namespaces.append(ns)
        return ns

    def opened(self) -> None:
        """The text being rendered depends on where the conversation ends."""
        index = self.index
        if index is None or index < 0:
            # the tail is rendered every time anyway; what the head leaves is compared
            return
        if self.first_open is None:
            self.first_open = index

    def loop_start(self, head: dict[str, Any]) -> None:
        """Before the first message of this render: check that the statements before the
        loop left what they left in the render being resumed (``head``: their variables),
        and restore the state this render was given."""
        self.head_state = (freeze(head), tuple(freeze(ns) for ns in self.namespaces))
        if self.state is not None:
            if not same_value(self.head_state, self.expect_head):
                raise StateMismatch("the statements before the loop left other values")
            if len(self.state) != len(self.namespaces):
                raise StateMismatch("the template made other namespaces before its loop")
            for ns, frozen in zip(self.namespaces, self.state, strict=True):
                thaw_into(ns, frozen)
        self.index = self.resume - 1

    def message_start(self) -> None:
        """At the start of each message: note its index and the state it starts from."""
        assert self.index is not None
        self.index += 1
        if self.first_open is None and self.namespaces:
            self.latest = tuple(freeze(ns) for ns in self.namespaces)

    def loop_end(self) -> tuple[Any, ...]:
        """After the last message: the state a render starting at ``first_open`` (or after
        the last message, when nothing depended on the end) must restore."""
        self.index = None
        if self.first_open is None and self.namespaces:
            return tuple(freeze(ns) for ns in self.namespaces)
        return self.latest if self.namespaces else ()


class TrackedMessages(Sequence[Any]):
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
        return reversed(self._items)

    def __contains__(self, value: object) -> bool:
        self._recorder.opened()
        return value in self._items


def _bounds(key: slice, recorder: Recorder) -> tuple[int, int | None] | None:
    """(start, stop) of a slice with step 1 and bounds from the start (``stop`` None: to the
    end). Anything else (negative bounds, other steps, such as ``messages[::-1]``) depends on
    the length: reported, and None (the caller slices plainly)."""
    start, stop, step = key.start, key.stop, key.step
    if (
        (step is not None and step != 1)
        or (start is not None and (type(start) is not int or start < 0))
        or (stop is not None and (type(stop) is not int or stop < 0))
    ):
        recorder.opened()
        return None
    return start or 0, stop


class _View(Sequence[Any]):
    """``messages[start:stop]`` (``stop`` None: to the end), tracked like the whole list."""

    __slots__ = ("_base", "_start", "_stop")

    def __init__(self, base: TrackedMessages, start: int, stop: int | None) -> None:
        self._base = base
        self._start = start
        self._stop = stop

    def _end(self) -> int:
        """The view's end; reports when it is the list's end rather than ``stop``."""
        length = len(self._base._items)
        if self._stop is None or self._stop > length:
            self._base._recorder.opened()
            return length
        return self._stop

    def __len__(self) -> int:
        return max(self._end() - self._start, 0)

    def __bool__(self) -> bool:
        length = len(self._base._items)
        stop = length if self._stop is None else min(self._stop, length)
        if stop <= self._start:
            self._base._recorder.opened()  # empty now, perhaps not when the list grows
            return False
        return True

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, slice):
            bounds = _bounds(key, self._base._recorder)
            if bounds is None:
                return list(self)[key]
            lo, hi = bounds
            stop = self._start + hi if hi is not None else self._stop
            if stop is not None and self._stop is not None:
                stop = min(stop, self._stop)
            return _View(self._base, self._start + lo, stop)
        if not isinstance(key, int) or key < 0:
            self._base._recorder.opened()
            return list(self)[key]
        at = self._start + key
        if self._stop is not None and at >= self._stop:
            raise IndexError(key)
        return self._base[at]

    def __iter__(self) -> Iterator[Any]:
        items = self._base._items
        stop = self._stop
        i = self._start
        while stop is None or i < stop:
            if i >= len(items):
                self._base._recorder.opened()  # ran off the end of the conversation
                return
            yield items[i]
            i += 1

    def __reversed__(self) -> Iterator[Any]:
        return reversed(list(self))

    def __contains__(self, value: object) -> bool:
        return any(v is value or v == value for v in self)

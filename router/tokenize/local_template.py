"""Chat templates rendered from the middle of the conversation: only the messages a
conversation added since a cached render are rendered again.

Most chat templates are one loop over ``messages`` whose body renders one message (ChatML,
Kimi, Llama-style role headers). The rendered prompt is then ``HEAD + BODY(0) + ... + BODY(n)
+ TAIL``, and the bodies of a prefix of the conversation do not change when messages are
appended, so a new turn of a long agentic session only needs ``BODY`` of its new messages and
``TAIL``: rendering cost grows with the new messages, not with the history
(``kvrouter bench tokenize``, docs/benchmarks.md).

Some templates carry state from message to message or look at other messages (Kimi-K3's
counts images and tool results in a ``namespace``, renders a run of tool results at its first
message, and looks back at the previous message's role). Those are rendered incrementally too:
the render records the namespaces at each message's start and notes the first message whose
text depended on where the conversation ends (router.tokenize.render_state); a later render
restores the state there and renders from that message on.

:func:`analyze` accepts a template from its Jinja AST, conservatively: any construct it does
not understand makes it refuse, and the caller renders the template whole (always correct,
just slower). A template is accepted when

* its *message loop* is the last top-level ``for`` over ``messages`` or over a name the
  statements before it assign (``loop_messages = messages[1:]``; when rendering it must be
  the conversation or a slice of it from a fixed start), with no ``else``, filter or
  ``recursive``; earlier loops over the conversation are part of the head; ``messages`` is
  assigned only before the loop (narrowed to a slice, say);
* the loop body uses only ``loop.first`` / ``loop.index`` / ``loop.index0`` of its loop
  (rewritten to count from the conversation's first message), never the loop object as a
  value, and has no ``break`` of the message loop;
* nothing in the loop body or in any macro changes between calls (``strftime_now``,
  ``lipsum``, the ``random`` filter) or reaches the template object (``self``); there is no
  include, import, block, call block, namespace-free state such as ``{% set x %}`` blocks in
  the loop body, or use of the instrumentation's reserved names.

Everything else is observed while rendering: reads of ``messages`` anywhere (a read that
depends on the conversation's length before the loop makes the render non-reusable) and
namespace state. The statements after the loop (usually the generation prompt) are rendered
every time, so they may read anything.

:class:`LocalTemplate` is the instrumented form: the loop iterates ``messages[start:]``, the
output carries per-process random marks around the loop and at each message, and
:meth:`~LocalTemplate.render_parts` splits ``(head, bodies, tail)`` and says where a later
render may resume (:class:`Resume`). ``render_parts(..., start=0)`` joined is exactly the
original template's output (tests/test_tokenize_local.py checks it on every bundled and test
template, and that resuming equals rendering whole).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import CodeType
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.visitor import NodeTransformer

from router.tokenize.render_state import Recorder, TrackedMessages

_START = "__kvrouter_start"
_ROWS = "__kvrouter_rows"  # the plain list the message loop iterates, from its start
_RESUME = "__kvrouter_resume"
_AT = "__kvrouter_at"
_END = "__kvrouter_end"
_LOOP_ATTRS = frozenset({"first", "index", "index0", "last"})
_LAST = "__kvrouter_last"  # reports ``loop.last`` when it is true (it depends on the end)
# Globals and filters whose output is not a function of their arguments: a cached body would
# keep an old date or draw.
_IMPURE_NAMES = frozenset({"strftime_now", "lipsum"})
_IMPURE_FILTERS = frozenset({"random", "shuffle"})
# filters that apply another filter or test named by their first argument
_BY_NAME = frozenset({"map", "select", "reject", "selectattr", "rejectattr"})
# Anywhere in the template: what reaches other templates or the template object, whose
# effects the render cannot observe.
_REJECTED_ANYWHERE = (
    nodes.CallBlock,
    nodes.Include,
    nodes.Import,
    nodes.FromImport,
    nodes.Extends,
    nodes.Block,
)
# Statements the loop body may not hold (unknown control flow or scoping).
_REJECTED = (
    *_REJECTED_ANYWHERE,
    nodes.Macro,  # macros are defined at the top level, not per message
    nodes.AssignBlock,
    nodes.Scope,
    nodes.OverlayScope,
    nodes.EvalContextModifier,
    nodes.ExprStmt,
)


@dataclass(slots=True, frozen=True)
class Resume:
    """Where a render of a longer conversation may start: at message ``start``, whose body
    begins ``offset`` characters into this render's ``bodies``, restoring ``state`` (the
    namespaces at that message's start; empty when the template has none), provided the
    statements before the loop leave ``head`` again (their variables and namespaces as the
    loop started: they may have read the whole conversation, e.g. to find the last user
    message)."""

    start: int
    offset: int
    state: tuple[Any, ...]
    head: Any


@dataclass(slots=True, frozen=True)
class RenderedParts:
    """One render from message ``start`` on: ``head`` (before the loop), ``bodies``
    (messages ``start..``), ``tail`` (after the loop), and where a later render of a longer
    conversation may resume (None: nowhere; the state could not be captured)."""

    head: str
    bodies: str
    tail: str
    resume: Resume | None
    # the head read the whole conversation (a new user query, say, can change it): a render
    # that can not resume then is better served by the rendered-text cache
    head_reads_end: bool = False


class _NotLocal(Exception):
    pass


def _assigned_names(stmts: Iterable[nodes.Node]) -> set[str]:
    names: set[str] = set()
    for stmt in stmts:
        for a in stmt.find_all((nodes.Assign, nodes.AssignBlock, nodes.For, nodes.With)):
            targets: list[nodes.Node] = []
            if isinstance(a, nodes.With):
                targets.extend(a.targets)
            elif isinstance(a, (nodes.Assign, nodes.AssignBlock, nodes.For)):
                targets.append(a.target)
            for t in targets:
                names |= _names(t)
        if isinstance(stmt, (nodes.Assign, nodes.For)):
            names |= _names(stmt.target)
    return names


class _BodyCheck:
    """Walks the message loop's body in document order (see the module docstring)."""

    def __init__(self, var: str) -> None:
        self.var = var
        self.locals: set[str] = set()

    def statements(self, stmts: Sequence[nodes.Node], *, depth: int) -> None:
        for stmt in stmts:
            self.node(stmt, depth=depth)

    def node(self, node: nodes.Node, *, depth: int) -> None:
        if isinstance(node, _REJECTED):
            raise _NotLocal(type(node).__name__)
        if isinstance(node, nodes.Break) and depth == 0:
            raise _NotLocal("break out of the message loop")
        if isinstance(node, nodes.Assign):
            # Jinja keeps nothing a ``set`` in the loop body assigns from one message to the
            # next (conditional or not); namespace attributes are recorded as state
            self.node(node.node, depth=depth)
            if isinstance(node.target, nodes.NSRef):
                self.name(nodes.Name(node.target.name, "load"), depth)
            else:
                self.locals |= _names(node.target)
            return
        if isinstance(node, nodes.For):
            if node.recursive:
                raise _NotLocal("recursive loop")
            self.node(node.iter, depth=depth)
            inner = _names(node.target)
            saved = set(self.locals)
            # Jinja resolves ``loop`` in an inner loop's filter and ``else`` block to the
            # *outer* loop: those are checked (and rewritten) at the outer depth
            self.locals |= inner
            if node.test is not None:
                self.node(node.test, depth=depth)
            self.locals = saved | inner | {"loop"}
            self.statements(node.body, depth=depth + 1)
            self.locals = set(saved)
            self.statements(node.else_, depth=depth)
            self.locals = saved
            return
        if isinstance(node, nodes.With):
            for value in node.values:
                self.node(value, depth=depth)
            saved = set(self.locals)
            self.locals |= {n for t in node.targets for n in _names(t)}
            self.statements(node.body, depth=depth)
            self.locals = saved
            return
        if isinstance(node, nodes.Getattr) and _is_name(node.node, "loop") and depth == 0:
            if "loop" in self.locals:  # shadowed by a user variable called loop: be safe
                raise _NotLocal("loop shadowed")
            if node.attr not in _LOOP_ATTRS:
                raise _NotLocal(f"loop.{node.attr}")
            return
        if isinstance(node, nodes.Name):
            self.name(node, depth)
            return
        if isinstance(node, (nodes.Filter, nodes.Test)):
            self.filter(node)
        for child in node.iter_child_nodes():
            self.node(child, depth=depth)

    @staticmethod
    def filter(node: nodes.Filter | nodes.Test) -> None:
        if node.name in _IMPURE_FILTERS:
            raise _NotLocal(f"the {node.name} filter")
        if node.name in _BY_NAME:  # ``map('random')``: the filter / test is an argument
            for arg in node.args:
                if not isinstance(arg, nodes.Const) or arg.value in _IMPURE_FILTERS:
                    raise _NotLocal(f"{node.name} with a dynamic or impure argument")

    def name(self, node: nodes.Name, depth: int) -> None:
        name = node.name
        if node.ctx != "load":
            return
        if name == self.var or name in self.locals:
            return
        if name == "loop":
            raise _NotLocal("the message loop's loop object used as a value")
        _check_name(name)


def _names(target: nodes.Node) -> set[str]:
    """The names a loop or ``with`` target binds (a name or a tuple of names)."""
    if isinstance(target, nodes.Name):
        return {target.name}
    return {n.name for n in target.find_all(nodes.Name)}


def _is_name(node: nodes.Node, name: str) -> bool:
    return isinstance(node, nodes.Name) and node.name == name


def _check_name(name: str) -> None:
    if name in _IMPURE_NAMES or name == "self" or name.startswith("__kvrouter"):
        raise _NotLocal(f"reads {name!r}")


def _check_impure_calls(ast: nodes.Template) -> None:
    """Functions whose output changes between calls may be called where the text is
    rendered every time (head, tail: the body and macros refuse them), never passed around:
    ``{% set now = strftime_now %}`` would carry one into the loop under another name."""
    called = {id(call.node) for call in ast.find_all(nodes.Call)}
    for name in ast.find_all(nodes.Name):
        if name.name in _IMPURE_NAMES and id(name) not in called:
            raise _NotLocal(f"{name.name} used as a value")


def _check_macros(ast: nodes.Template) -> None:
    """Macros run on behalf of the loop body: nothing in them may change between calls."""
    for macro in ast.find_all(nodes.Macro):
        for name in macro.find_all(nodes.Name):
            if name.ctx == "load":
                _check_name(name.name)
        for node in macro.find_all((nodes.Filter, nodes.Test)):
            assert isinstance(node, nodes.Filter | nodes.Test)  # what find_all was asked for
            _BodyCheck.filter(node)


class _Rewrite(NodeTransformer):
    """``loop.first/index/index0`` of the message loop, counted from ``start``."""

    def __init__(self) -> None:
        self.depth = 0

    def visit_For(self, node: nodes.For) -> nodes.Node:
        node.iter = self.visit(node.iter)
        if node.test is not None:  # sees the outer loop (see _BodyCheck)
            node.test = self.visit(node.test)
        node.else_ = [self.visit(n) for n in node.else_]
        self.depth += 1
        try:
            node.body = [self.visit(n) for n in node.body]
        finally:
            self.depth -= 1
        return node

    def visit_Getattr(self, node: nodes.Getattr) -> nodes.Node:
        if self.depth == 0 and _is_name(node.node, "loop") and node.attr in _LOOP_ATTRS:
            start = nodes.Name(_START, "load")
            if node.attr == "first":
                at_zero = nodes.Compare(start, [nodes.Operand("eq", nodes.Const(0))])
                return nodes.And(node, at_zero)
            if node.attr == "last":  # the same value in the sliced loop; true: it may change
                return nodes.Call(nodes.Name(_LAST, "load"), [node], [], None, None)
            return nodes.Add(node, start)
        return self.generic_visit(node)


class LocalTemplate:
    """The instrumented, incrementally renderable form of a template :func:`analyze`
    accepted."""

    def __init__(self, env: jinja2.Environment, code: CodeType) -> None:
        """``code``: :func:`instrument`'s for the template (a fresh form each time: its
        marks and its state below are its own)."""
        token = os.urandom(12).hex()
        self._mark = "\x00kvrouter-" + token + "\x00"
        self._mark_msg = "\x00kvrouter-msg-" + token + "\x00"
        self._mark_end = "\x00kvrouter-end-" + token + "\x00"
        self._template = env.template_class.from_code(env, code, env.make_globals(None), None)
        self.enabled = True
        self._failures = 0  # in a row
        self._poor = 0  # whole renders in a row that left nothing to resume from

    # After this many instrumented renders in a row that failed where the plain template
    # rendered, this form is not used again: a template that fails on every conversation
    # (it serialises ``messages``, say) costs a few wasted renders, not one per request,
    # while one that fails only on some conversations keeps serving the others.
    FAILURES_TO_DISABLE = 3

    def failed(self) -> None:
        """Its render failed where the plain template's did not (the caller rendered whole)."""
        self._failures += 1
        if self._failures >= self.FAILURES_TO_DISABLE:
            self.enabled = False

    def observe(self, reusable: bool) -> None:
        """Whether a whole render gave a later turn something to resume from. A template
        whose renders do not, several times in a row, is handed to the rendered-text cache
        (``enabled`` False), which reuses more for it: its messages do not start with a
        special token (a role name first, GigaChat), so no cut between them is exact; or its
        message loop is not the one that renders the conversation (DeepSeek-V3.2 loops over
        ``messages[start_idx:]``, an expression, after a scan over ``messages``), so the
        conversation lands in the tail."""
        self._poor = 0 if reusable else self._poor + 1
        if self._poor >= self.FAILURES_TO_DISABLE:
            self.enabled = False

    def render_parts(
        self, variables: Mapping[str, Any], start: int, resume: Resume | None = None
    ) -> RenderedParts:
        """Render with the message loop starting at ``start`` (the caller's ``variables``
        hold the whole conversation as ``messages``), from ``resume``: the :class:`Resume`
        of a render of a conversation this one extends, whose ``start`` this is (None with
        ``start`` 0). Raises what Jinja raises, and StateMismatch when ``resume`` does not
        fit (the statements before the loop left other values this time)."""
        items = variables["messages"]
        rec = Recorder(start, resume.state if resume else None, resume.head if resume else None)
        mark, mark_msg, mark_end = self._mark, self._mark_msg, self._mark_end

        def loop_start(head: dict[str, Any]) -> str:
            rec.loop_start(head)
            return mark

        def last(value: Any) -> Any:
            if value:
                rec.opened()
            return value

        def at() -> str:
            rec.message_start()
            return mark_msg

        ended: list[tuple[int, tuple[Any, ...]] | None] = []

        def end() -> str:
            ended.append(rec.loop_end())
            return mark_end

        out = self._template.render(
            {
                **variables,
                "messages": TrackedMessages(items, rec),
                "namespace": rec.namespace,
                _ROWS: rec.rows,
                _START: start,
                _RESUME: loop_start,
                _LAST: last,
                _AT: at,
                _END: end,
            }
        )
        i = out.find(mark)
        j = out.find(mark_end, i + 1)
        if i < 0 or j < 0 or not ended:  # an ``{% if %}`` can not skip the marks
            raise RuntimeError("instrumented template lost its marks")
        pieces = out[i + len(mark) : j].split(mark_msg)
        if pieces[0] or len(pieces) != rec.loop_length - start + 1:
            raise RuntimeError("instrumented template lost its message marks")
        resume_point = None
        good = ended[0]
        if good is not None and rec.resumable:
            at_message, state = good
            offset = sum(len(p) for p in pieces[1 : 1 + at_message - start])
            resume_point = Resume(at_message, offset, state, rec.head_state)
        self._failures = 0
        return RenderedParts(
            out[:i], "".join(pieces), out[j + len(mark_end) :], resume_point, rec.head_reads_end
        )


def _name_sliced_loops(ast: nodes.Template) -> None:
    """``{% for m in messages[start:] %}`` at the top level (DeepSeek-V3.2, with
    ``start_idx`` set before it) becomes ``{% set __kvrouter_rowsN = messages[start:] %}``
    and a loop over that name: the form :func:`analyze` takes for a message loop, where the
    slice is checked when rendering and compared as a head variable when resuming."""
    body: list[nodes.Node] = []
    for i, n in enumerate(ast.body):
        it = n.iter if isinstance(n, nodes.For) else None
        if (
            isinstance(n, nodes.For)
            and isinstance(it, nodes.Getitem)
            and _is_name(it.node, "messages")
            and isinstance(it.arg, nodes.Slice)
            and it.arg.stop is None
            and it.arg.step is None
        ):
            name = f"__kvrouter_rows{i}"
            body.append(nodes.Assign(nodes.Name(name, "store"), it, lineno=n.lineno))
            n.iter = nodes.Name(name, "load", lineno=n.lineno)
        body.append(n)
    ast.body = body


def analyze(env: jinja2.Environment, source: str) -> LocalTemplate | None:
    """The instrumented template if ``source`` is message-local (see the module
    docstring), else None."""
    code = instrument(env, source)
    return None if code is None else LocalTemplate(env, code)


def instrument(env: jinja2.Environment, source: str) -> CodeType | None:
    """The compiled instrumented form of ``source`` if it is message-local, else None: a
    function of the source and the environment's settings alone (its code holds no state)."""
    try:
        ast = env.parse(source)
        if any(n.name.startswith("__kvrouter") for n in ast.find_all(nodes.Name)):
            raise _NotLocal("uses the instrumentation's reserved names")
        _name_sliced_loops(ast)
        # The message loop: the last top-level loop over ``messages`` or over a name the
        # statements before it assign (``loop_messages = messages[1:]``, checked when
        # rendering: it must be ``messages`` or a slice of it from a fixed start). Earlier
        # loops over the conversation are part of the head, later ones of the tail: both
        # are rendered every time, so the choice never makes a render wrong.
        loops = [
            (i, n)
            for i, n in enumerate(ast.body)
            if isinstance(n, nodes.For)
            and isinstance(n.iter, nodes.Name)
            and (n.iter.name == "messages" or n.iter.name in _assigned_names(ast.body[:i]))
        ]
        if not loops:
            raise _NotLocal("no top-level loop over messages")
        if any(True for _ in ast.find_all(_REJECTED_ANYWHERE)):
            raise _NotLocal("call block, block, include or import")
        at, loop = loops[-1]
        # before the loop ``messages`` may be narrowed (``set messages = messages[1:]``: a
        # tracked slice; the loop checks what it runs over), not in the loop or in macros
        if "messages" in _assigned_names([*loop.body, *ast.find_all(nodes.Macro)]):
            raise _NotLocal("messages is assigned in the message loop or a macro")
        if loop.else_ or loop.test is not None or loop.recursive:
            raise _NotLocal("loop with else, filter or recursion")
        if not isinstance(loop.target, nodes.Name):
            raise _NotLocal("loop target is not a name")
        _check_macros(ast)
        _check_impure_calls(ast)
        _BodyCheck(loop.target.name).statements(loop.body, depth=0)
    except (_NotLocal, jinja2.TemplateSyntaxError):
        return None
    loop.body = [
        nodes.Output([nodes.Call(nodes.Name(_AT, "load"), [], [], None, None)]),
        *(_Rewrite().visit(n) for n in loop.body),
    ]
    loop.iter = nodes.Call(
        nodes.Name(_ROWS, "load"), [loop.iter, nodes.Name(_START, "load")], [], None, None
    )
    # the names the statements before the loop assign, as they are when the loop starts
    head_names = sorted(_assigned_names(ast.body[:at]))
    head_values = nodes.Dict(
        [nodes.Pair(nodes.Const(n), nodes.Name(n, "load")) for n in head_names]
    )
    ast.body[at : at + 1] = [
        nodes.Output([nodes.Call(nodes.Name(_RESUME, "load"), [head_values], [], None, None)]),
        loop,
        nodes.Output([nodes.Call(nodes.Name(_END, "load"), [], [], None, None)]),
    ]
    ast.set_lineno(1)  # the new nodes need one for the code generator
    ast.set_environment(env)
    code: CodeType = env.compile(ast)
    return code

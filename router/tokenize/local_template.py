"""Message-local chat templates: render only the messages a conversation added.

Most chat templates are one loop over ``messages`` whose body renders a message from that
message alone (ChatML, Kimi, Llama-style role headers). For such a template the rendered
prompt is ``HEAD + BODY(m0, 0) + ... + BODY(mn, n) + TAIL`` and the text of a prefix of the
conversation never changes when messages are appended, so a new turn of a long agentic session
only needs ``BODY`` of its new messages and ``TAIL``: rendering cost no longer grows with the
history (554 messages: ~3.5 ms for the whole template, ~0.05 ms for the new turn).

:func:`analyze` proves that property from the template's Jinja AST, conservatively: any
construct it does not understand makes the template non-local, and the caller renders it whole
(always correct, just slower). A template is local when

* its top level holds exactly one ``for <name> in messages`` loop (no ``else``, filter or
  ``recursive``), and ``messages`` is never assigned;
* the statements before the loop read ``messages`` only as ``messages[0]`` (the cached prefix
  always contains it), so ``HEAD`` is the same for every continuation of a conversation;
* the loop body reads only: the message, ``messages[0]`` (Kimi's templates test its role on
  the first iteration), ``loop.first`` / ``loop.index`` / ``loop.index0`` (rewritten to count
  from the first rendered message), names it assigns itself
  unconditionally before reading them, and inputs the template never assigns (``tools``,
  ``bos_token``, template kwargs, pure globals); it has no ``break`` of the message loop, no
  namespace assignment, macro, call block, include, import or block, and nothing whose output
  changes between calls (``strftime_now``, ``lipsum``, the ``random`` filter).

The statements after the loop (usually the generation prompt) are rendered every time with
the whole conversation, so they may read anything.

:class:`LocalTemplate` is the instrumented form: the loop iterates ``messages[start:]`` and the
output carries two per-process random marks around the loop, from which :meth:`render_parts`
splits ``(head, bodies, tail)``. ``render_parts(..., start=0)`` joined is exactly the original
template's output (tests/test_tokenize_local.py checks it on every bundled and test template).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.visitor import NodeTransformer

_START = "__kvrouter_start"
_MARK = "__kvrouter_mark"
_MARK_END = "__kvrouter_mark_end"
_LOOP_ATTRS = frozenset({"first", "index", "index0"})
# Globals and filters whose output is not a function of their arguments: a cached body would
# keep an old date or draw.
_IMPURE_NAMES = frozenset({"strftime_now", "lipsum"})
_IMPURE_FILTERS = frozenset({"random", "shuffle"})
# filters that apply another filter or test named by their first argument
_BY_NAME = frozenset({"map", "select", "reject", "selectattr", "rejectattr"})
# Anywhere in the template: a macro or block can carry state between messages (through a
# namespace or ``self``) and is called from the loop body.
_REJECTED_ANYWHERE = (
    nodes.Macro,
    nodes.CallBlock,
    nodes.Include,
    nodes.Import,
    nodes.FromImport,
    nodes.Extends,
    nodes.Block,
)
# Statements that may hide cross-message state or unknown control flow (in the loop body).
_REJECTED = (
    *_REJECTED_ANYWHERE,
    nodes.NSRef,
    nodes.AssignBlock,
    nodes.Scope,
    nodes.OverlayScope,
    nodes.EvalContextModifier,
    nodes.ExprStmt,
)


@dataclass(slots=True, frozen=True)
class RenderedParts:
    """One render of a local template from message ``start`` on: ``head`` (before the loop),
    ``bodies`` (messages ``start..``), ``tail`` (after the loop)."""

    head: str
    bodies: str
    tail: str


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

    def __init__(self, var: str, outer_assigned: set[str]) -> None:
        self.var = var
        self.outer_assigned = outer_assigned
        self.locals: set[str] = set()

    def statements(self, stmts: Sequence[nodes.Node], *, top: bool, depth: int) -> None:
        for stmt in stmts:
            self.node(stmt, top=top, depth=depth)

    def node(self, node: nodes.Node, *, top: bool, depth: int) -> None:
        if isinstance(node, _REJECTED):
            raise _NotLocal(type(node).__name__)
        if isinstance(node, nodes.Break) and depth == 0:
            raise _NotLocal("break out of the message loop")
        if isinstance(node, nodes.Assign):
            self.node(node.node, top=False, depth=depth)
            if not isinstance(node.target, nodes.Name):
                raise _NotLocal("tuple or attribute assignment")
            if not top and node.target.name not in self.locals:
                raise _NotLocal(f"conditional assignment of {node.target.name!r}")
            self.locals.add(node.target.name)
            return
        if isinstance(node, nodes.For):
            if node.recursive:
                raise _NotLocal("recursive loop")
            self.node(node.iter, top=False, depth=depth)
            inner = _names(node.target)
            saved = set(self.locals)
            # Jinja resolves ``loop`` in an inner loop's filter and ``else`` block to the
            # *outer* loop: those are checked (and rewritten) at the outer depth
            self.locals |= inner
            if node.test is not None:
                self.node(node.test, top=False, depth=depth)
            self.locals = saved | inner | {"loop"}
            self.statements(node.body, top=False, depth=depth + 1)
            self.locals = set(saved)
            self.statements(node.else_, top=False, depth=depth)
            self.locals = saved
            return
        if isinstance(node, nodes.With):
            for value in node.values:
                self.node(value, top=False, depth=depth)
            saved = set(self.locals)
            self.locals |= {n for t in node.targets for n in _names(t)}
            self.statements(node.body, top=False, depth=depth)
            self.locals = saved
            return
        if _is_first_message(node):
            return  # in every cached prefix (and compared): the same in a full render
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
            self.node(child, top=False, depth=depth)

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
        if (
            name == "messages"
            or name in self.outer_assigned
            or name in _IMPURE_NAMES
            or name == "self"
            or name.startswith("__kvrouter")
        ):
            raise _NotLocal(f"the body reads {name!r}")


def _names(target: nodes.Node) -> set[str]:
    """The names a loop or ``with`` target binds (a name or a tuple of names)."""
    if isinstance(target, nodes.Name):
        return {target.name}
    return {n.name for n in target.find_all(nodes.Name)}


def _is_first_message(node: nodes.Node) -> bool:
    """``messages[0]``: the conversation's first message."""
    return (
        isinstance(node, nodes.Getitem)
        and _is_name(node.node, "messages")
        and isinstance(node.arg, nodes.Const)
        and node.arg.value == 0
        and type(node.arg.value) is int
    )


def _is_name(node: nodes.Node, name: str) -> bool:
    return isinstance(node, nodes.Name) and node.name == name


def _check_head(stmts: Sequence[nodes.Node]) -> None:
    """Statements before the loop may read ``messages`` only as ``messages[0]``."""
    allowed: set[int] = set()
    for stmt in stmts:
        if isinstance(stmt, _REJECTED):
            raise _NotLocal(type(stmt).__name__)
        for item in stmt.find_all(nodes.Getitem):
            if _is_first_message(item):
                allowed.add(id(item.node))
        for name in stmt.find_all(nodes.Name):
            if name.name == "messages" and id(name) not in allowed:
                raise _NotLocal("the statements before the loop read messages")


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
            return nodes.Add(node, start)
        return self.generic_visit(node)


class LocalTemplate:
    """The instrumented, incrementally renderable form of a message-local template."""

    def __init__(self, env: jinja2.Environment, ast: nodes.Template) -> None:
        self._mark = "\x00kvrouter-" + os.urandom(12).hex() + "\x00"
        self._mark_end = "\x00kvrouter-end-" + os.urandom(12).hex() + "\x00"
        self._template = env.template_class.from_code(
            env, env.compile(ast), env.make_globals(None), None
        )

    def render_parts(self, variables: Mapping[str, Any], start: int) -> RenderedParts:
        """Render with the message loop starting at ``start`` (the caller's ``variables``
        hold the whole conversation as ``messages``). Raises what Jinja raises."""
        out = self._template.render(
            {**variables, _START: start, _MARK: self._mark, _MARK_END: self._mark_end}
        )
        i = out.find(self._mark)
        j = out.find(self._mark_end, i + 1)
        if i < 0 or j < 0:  # an ``{% if %}`` can not skip the marks: they are top level
            raise RuntimeError("instrumented template lost its marks")
        return RenderedParts(out[:i], out[i + len(self._mark) : j], out[j + len(self._mark_end) :])


def analyze(env: jinja2.Environment, source: str) -> LocalTemplate | None:
    """The instrumented template if ``source`` is message-local, else None."""
    try:
        ast = env.parse(source)
        loops = [
            (i, n)
            for i, n in enumerate(ast.body)
            if isinstance(n, nodes.For) and _is_name(n.iter, "messages")
        ]
        if len(loops) != 1:
            raise _NotLocal("not exactly one top-level loop over messages")
        if "messages" in _assigned_names(ast.body):
            raise _NotLocal("messages is assigned")
        if any(True for _ in ast.find_all(_REJECTED_ANYWHERE)):
            raise _NotLocal("macro, block, include or import")
        if any(n.name.startswith("__kvrouter") for n in ast.find_all(nodes.Name)):
            raise _NotLocal("uses the instrumentation's reserved names")
        at, loop = loops[0]
        if loop.else_ or loop.test is not None or loop.recursive:
            raise _NotLocal("loop with else, filter or recursion")
        if not isinstance(loop.target, nodes.Name):
            raise _NotLocal("loop target is not a name")
        _check_head(ast.body[:at])
        outer = _assigned_names(ast.body) - {loop.target.name}
        _BodyCheck(loop.target.name, outer).statements(loop.body, top=True, depth=0)
    except (_NotLocal, jinja2.TemplateSyntaxError):
        return None
    loop.body = [_Rewrite().visit(n) for n in loop.body]
    loop.iter = nodes.Getitem(
        nodes.Name("messages", "load"),
        nodes.Slice(nodes.Name(_START, "load"), None, None),
        "load",
    )
    ast.body[at : at + 1] = [
        nodes.Output([nodes.Name(_MARK, "load")]),
        loop,
        nodes.Output([nodes.Name(_MARK_END, "load")]),
    ]
    ast.set_lineno(1)  # the new nodes need one for the code generator
    ast.set_environment(env)
    return LocalTemplate(env, ast)

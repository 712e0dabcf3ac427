"""A small GraphQL executor for the stand-ins of APIs that speak it (RunPod): parses a
document (``query``/``mutation``, an optional name and variable definitions, fields with
aliases and arguments: strings, numbers, booleans, null, enums, variables, lists and
objects), runs its root fields with the stand-in's resolvers and answers only the fields
selected, as a GraphQL server does (``{"data": ...}`` or ``{"errors": [{"message"}]}``)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

_TOKEN = re.compile(
    r'\s+|,|#[^\n]*|(?P<str>"(?:[^"\\]|\\.)*")|(?P<num>-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?)'
    r"|(?P<name>[_A-Za-z][_0-9A-Za-z]*)|(?P<punct>\.\.\.|[{}()\[\]:!$=@])"
)


class GraphQLError(Exception):
    """An error a resolver reports (its message goes to ``errors``)."""


@dataclass
class Field:
    name: str
    alias: str
    args: dict[str, Any] = field(default_factory=dict)
    selections: list[Field] = field(default_factory=list)


def _tokens(text: str) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    pos = 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            raise GraphQLError(f"Syntax Error: unexpected character {text[pos]!r}")
        pos = m.end()
        kind = m.lastgroup
        if kind:
            out.append((kind, m.group(kind)))
    return out


class _Parser:
    def __init__(self, text: str, variables: dict[str, Any]) -> None:
        self.toks = _tokens(text)
        self.i = 0
        self.variables = variables

    def peek(self) -> tuple[str, str]:
        return self.toks[self.i] if self.i < len(self.toks) else ("eof", "")

    def take(self, value: str | None = None) -> str:
        kind, text = self.peek()
        if kind == "eof" or (value is not None and text != value):
            raise GraphQLError(f"Syntax Error: expected {value or 'a token'}, found {text!r}")
        self.i += 1
        return text

    def document(self) -> tuple[str, list[Field]]:
        kind = "query"
        if self.peek()[1] in ("query", "mutation"):
            kind = self.take()
            if self.peek()[0] == "name":
                self.take()
            if self.peek()[1] == "(":  # variable definitions: their types are not checked
                depth = 0
                while True:
                    t = self.take()
                    depth += {"(": 1, ")": -1}.get(t, 0)
                    if depth == 0:
                        break
        return kind, self.selection_set()

    def selection_set(self) -> list[Field]:
        self.take("{")
        out = []
        while self.peek()[1] != "}":
            out.append(self.field())
        self.take("}")
        return out

    def field(self) -> Field:
        name = self.take()
        alias = name
        if self.peek()[1] == ":":
            self.take(":")
            name = self.take()
        f = Field(name, alias)
        if self.peek()[1] == "(":
            self.take("(")
            while self.peek()[1] != ")":
                key = self.take()
                self.take(":")
                f.args[key] = self.value()
            self.take(")")
        if self.peek()[1] == "{":
            f.selections = self.selection_set()
        return f

    def value(self) -> Any:
        kind, text = self.peek()
        if text == "$":
            self.take()
            return self.variables.get(self.take())
        if text == "[":
            self.take()
            items = []
            while self.peek()[1] != "]":
                items.append(self.value())
            self.take("]")
            return items
        if text == "{":
            self.take()
            obj = {}
            while self.peek()[1] != "}":
                key = self.take()
                self.take(":")
                obj[key] = self.value()
            self.take("}")
            return obj
        self.take()
        if kind == "str":
            return json.loads(text)
        if kind == "num":
            return float(text) if any(c in text for c in ".eE") else int(text)
        return {"true": True, "false": False, "null": None}.get(text, text)  # enums: names


Resolver = Callable[[dict[str, Any]], Any]


def execute(
    text: str,
    variables: dict[str, Any] | None,
    queries: dict[str, Resolver],
    mutations: dict[str, Resolver],
) -> dict[str, Any]:
    """Run a document: each root field's resolver gets its arguments and returns plain
    data (dicts, lists, scalars; a callable field value is called with the field's
    arguments); the answer holds only the fields selected."""
    try:
        kind, fields = _Parser(text, variables or {}).document()
        roots = mutations if kind == "mutation" else queries
        data: dict[str, Any] = {}
        for f in fields:
            if f.name not in roots:
                raise GraphQLError(f'Cannot query field "{f.name}" on type "{kind.title()}".')
            data[f.alias] = _select(roots[f.name](f.args), f.selections)
        return {"data": data}
    except GraphQLError as e:
        return {"errors": [{"message": str(e)}], "data": None}


def _select(value: Any, selections: list[Field]) -> Any:
    if callable(value):
        value = value({})
    if not selections or value is None:
        return value
    if isinstance(value, list):
        return [_select(v, selections) for v in value]
    out = {}
    for f in selections:
        if f.name == "__typename":
            out[f.alias] = "Object"
            continue
        if f.name not in value:
            raise GraphQLError(f'Cannot query field "{f.name}" on this type.')
        item = value[f.name]
        if callable(item):
            item = item(f.args)
        out[f.alias] = _select(item, f.selections)
    return out

"""A bounded YAML loader for task files: hostile or broken files are refused, fast.

Task files come from anywhere (a colleague, a repository, a web page). PyYAML's safe
loader still lets a few hundred bytes cost minutes and gigabytes: aliases that expand
exponentially (a "billion laughs", worst in a mapping *key*, which is turned into a
string before anyone can refuse it), nesting deep enough to overflow the stack, and tags
it refuses only with a traceback. This module composes the file into PyYAML's node graph,
where an alias is one shared node and costs nothing, and checks that graph *before*
anything is constructed from it:

- at most :data:`MAX_BYTES` of UTF-8 (other bytes: the line and the byte);
- nesting at most :data:`MAX_DEPTH` levels, counted through aliases too;
- aliases may add at most :data:`MAX_ALIAS_NODES` nodes to the document (and never refer
  to a node that contains them);
- mapping keys are plain strings (no lists, mappings, numbers or nulls as keys; no ``<<``
  merge keys);
- only plain YAML tags: strings, numbers, booleans, null, dates, lists and mappings (no
  ``!!python/...``, no application tags).

Each refusal is a :class:`YamlRefused` with the 1-based line it concerns; the task file
parser turns it into a ``file:line`` error. Checking is linear in the file's size.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import yaml

MAX_BYTES = 256 * 1024
"""Task files larger than this are refused (real ones are a few KB)."""
MAX_DEPTH = 64
"""Deepest nesting of lists and mappings accepted."""
MAX_ALIAS_NODES = 10_000
"""Nodes that aliases may add to a document, in total, once expanded."""
MAX_NUMBER_CHARS = 100
"""Longest number accepted (Python refuses to parse integers past 4300 digits)."""

_CORE = "tag:yaml.org,2002:"
_ALLOWED = {_CORE + t for t in ("str", "int", "float", "bool", "null", "timestamp", "seq", "map")}


class YamlRefused(Exception):
    """A task file the bounded loader refuses.

    Attributes:
        line: 1-based line the problem is on (0: the whole file).
        message: what is wrong and how to fix it.
    """

    def __init__(self, line: int, message: str) -> None:
        super().__init__(message)
        self.line = line
        self.message = message


def compose(data: bytes) -> yaml.Node | None:
    """The checked node graph of the YAML document in ``data`` (None when it is empty).

    Raises YamlRefused for everything the module docstring lists and ``yaml.YAMLError``
    for syntax errors (which carry their own position).
    """
    if len(data) > MAX_BYTES:
        raise YamlRefused(
            0,
            f"the file is larger than {MAX_BYTES // 1024} KB, the most a task file may be "
            "(keep large data in files the task reads, e.g. through `file_mounts`)",
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise YamlRefused(
            line,
            f"the file is not UTF-8: byte 0x{data[e.start]:02x} at column {column}; "
            "save it as UTF-8",
        ) from None
    loader = _loader_class()(text)
    try:
        root = loader.get_single_node()
        aliases = loader.aliases  # type: ignore[attr-defined]
    finally:
        loader.dispose()
    if root is not None:
        _check(root, aliases)
    return root


def compose_all(data: bytes) -> list[yaml.Node]:
    """The checked node graphs of every YAML document in ``data`` (``---`` between them),
    as :func:`compose` checks one; empty documents are skipped. Lines stay the file's."""
    if len(data) > MAX_BYTES:
        compose(data)  # raises the size refusal
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        compose(data)  # raises the encoding refusal with its line
        raise
    import yaml

    loader = _loader_class()(text)
    roots: list[yaml.Node] = []
    try:
        while loader.check_node():
            loader.aliases = []  # type: ignore[attr-defined]
            root = loader.get_node()
            empty = isinstance(root, yaml.ScalarNode) and root.tag == _CORE + "null"
            if root is not None and not (empty and not root.value):  # `---` with nothing
                _check(root, loader.aliases)  # type: ignore[attr-defined]
                roots.append(root)
    finally:
        loader.dispose()
    return roots


def _line(node: yaml.Node) -> int:
    return int(node.start_mark.line) + 1


_LOADER: type[yaml.SafeLoader] | None = None


def _loader_class() -> type[yaml.SafeLoader]:
    """The SafeLoader subclass that bounds nesting while composing (built on first use:
    PyYAML is imported only by commands that read a task file)."""
    global _LOADER
    if _LOADER is not None:
        return _LOADER
    import yaml

    class BoundedLoader(yaml.SafeLoader):
        def __init__(self, stream: str) -> None:
            super().__init__(stream)
            self.depth = 0
            self.aliases: list[tuple[int, yaml.Node]] = []  # (line, target) per alias

        def fetch_flow_collection_start(self, token_class: type) -> None:
            # the scanner reads a flow collection ([...] or {...}) to its end before the
            # composer sees it: refuse deep flow nesting while scanning, not after
            if self.flow_level >= MAX_DEPTH:
                raise YamlRefused(
                    int(self.get_mark().line) + 1,
                    f"nested deeper than {MAX_DEPTH} levels: flatten the structure",
                )
            super().fetch_flow_collection_start(token_class)

        def add_indent(self, column: int) -> bool:
            if len(self.indents) >= MAX_DEPTH:
                raise YamlRefused(
                    int(self.get_mark().line) + 1,
                    f"nested deeper than {MAX_DEPTH} levels: flatten the structure",
                )
            return bool(super().add_indent(column))

        def compose_node(self, parent: yaml.Node | None, index: int) -> yaml.Node | None:
            event = self.peek_event()  # type: ignore[no-untyped-call]
            line = int(event.start_mark.line) + 1
            if isinstance(event, yaml.AliasEvent):
                node = super().compose_node(parent, index)
                if node is not None:
                    self.aliases.append((line, node))
                return node
            self.depth += 1
            try:
                if self.depth > MAX_DEPTH:
                    raise YamlRefused(
                        line,
                        f"nested deeper than {MAX_DEPTH} levels: flatten the structure",
                    )
                return super().compose_node(parent, index)
            finally:
                self.depth -= 1

    _LOADER = BoundedLoader
    return _LOADER


def _children(node: yaml.Node) -> list[yaml.Node]:
    import yaml

    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return []


def _check_node(node: yaml.Node) -> None:
    """Tags, keys and numbers of one node (its children are checked on their own)."""
    import yaml

    tag = str(node.tag)
    if tag == _CORE + "merge":
        raise YamlRefused(_line(node), "merge keys (<<) are not supported: write the fields out")
    if tag not in _ALLOWED:
        shown = "!!" + tag[len(_CORE) :] if tag.startswith(_CORE) else tag
        raise YamlRefused(
            _line(node),
            f"the tag {shown[:80]} is not allowed: task files hold plain YAML only "
            "(strings, numbers, booleans, lists, mappings)",
        )
    if isinstance(node, yaml.ScalarNode):
        if tag in (_CORE + "int", _CORE + "float") and len(node.value) > MAX_NUMBER_CHARS:
            raise YamlRefused(
                _line(node), f"a number of {len(node.value)} characters: quote it or shorten it"
            )
        return
    if isinstance(node, yaml.MappingNode):
        for key, _value in node.value:
            if not isinstance(key, yaml.ScalarNode):
                kind = "a list" if isinstance(key, yaml.SequenceNode) else "a mapping"
                raise YamlRefused(_line(key), f"a field name must be a string, not {kind}")
            if key.tag == _CORE + "merge":
                raise YamlRefused(
                    _line(key), "merge keys (<<) are not supported: write the fields out"
                )
            if key.tag != _CORE + "str":
                raise YamlRefused(
                    _line(key),
                    f"a field name must be a string, got {key.value[:40]!r} "
                    f"(a {str(key.tag).rpartition(':')[2]}): quote it",
                )


def _check(root: yaml.Node, aliases: list[tuple[int, yaml.Node]]) -> None:
    """Check every node once; compute each node's expanded size and height (aliases
    counted as what they stand for) without expanding anything."""
    size: dict[int, int] = {}
    height: dict[int, int] = {}
    entered: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        key = id(node)
        if done:
            kids = _children(node)
            size[key] = 1 + sum(size[id(k)] for k in kids)
            height[key] = 1 + max((height[id(k)] for k in kids), default=0)
            entered.discard(key)
            if height[key] > MAX_DEPTH:
                raise YamlRefused(
                    _line(node),
                    f"nested deeper than {MAX_DEPTH} levels once its aliases are expanded: "
                    "flatten the structure",
                )
            continue
        if key in size:
            continue
        if key in entered:
            raise YamlRefused(_line(node), "an alias refers to a node that contains it")
        _check_node(node)
        entered.add(key)
        stack.append((node, True))
        stack.extend((k, False) for k in _children(node) if id(k) not in size)
    added = size[id(root)] - len(size)
    if added > MAX_ALIAS_NODES:
        line, _ = max(aliases, key=lambda a: size.get(id(a[1]), 0))
        raise YamlRefused(
            line,
            f"aliases (*name) would expand the file by {_count(added)} nodes (at most "
            f"{MAX_ALIAS_NODES:,} are allowed): write the values out instead",
        )


def _count(n: int) -> str:
    return f"{n:,}" if n < 10**15 else f"about 10^{len(str(n)) - 1}"

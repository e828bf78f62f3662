"""The read-only rule for user SQL: one statement, parsed by ClickHouse itself, checked against allow-lists.

A keyword check is not enough (comments, ``SELECT ... INTO OUTFILE``, ``SELECT 1; DROP ...``, table functions
that read files or call URLs), and neither is the ``readonly`` setting (it lets ``INTO OUTFILE`` and the
``file()`` function through, and a query may carry its own ``SETTINGS``). So every query goes through the
engine's own parser twice:

1. ``formatQuerySingleLine(<sql>)``: the engine parses the text as exactly one statement (a second statement
   is a syntax error) and prints it back canonically, without comments. That text is what runs.
2. ``EXPLAIN AST <formatted>``: the syntax tree of that text, which :func:`check_tree` walks.

The tree passes when:

* its root is a read: ``SELECT`` (with ``WITH``, ``UNION``, ``INTERSECT``, ``EXCEPT``), ``SHOW TABLES`` /
  ``DATABASES`` / ``COLUMNS`` / ``CREATE TABLE``, ``DESCRIBE``, ``EXISTS``, or ``EXPLAIN`` of one of those;
* no ``INTO OUTFILE`` and no ``SETTINGS`` clause (the reader sets the limits; a query may not lift them);
* every table function is on :data:`TABLE_FUNCTIONS` (an allow-list: ``file``, ``url``, ``s3``, ``remote``,
  ``executable``, ``input``, ``mysql``... are not on it), and no scalar function is on
  :data:`FORBIDDEN_FUNCTIONS` (``file`` reads a file, ``sleep*`` holds a thread, introspection);
* every table is in Fulmen's database, an unqualified name (a ``WITH`` name, or the reader's current
  database), or one of :data:`SYSTEM_TABLES`.

The check raises :class:`ReadOnlyError` naming what was refused; it never runs the statement.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from fulmen.schemas.errors import PoisonInputError

__all__ = [
    "FORBIDDEN_FUNCTIONS",
    "OUTPUT_FORMAT",
    "SYSTEM_TABLES",
    "TABLE_FUNCTIONS",
    "AstNode",
    "ReadOnlyError",
    "ReadStatement",
    "check_read",
    "check_tree",
    "parse_ast_dump",
]


class ReadOnlyError(PoisonInputError):
    """A statement refused where only reads are allowed (a write, DDL, a file or network access...)."""


# Roots that read. ShowTables also covers SHOW DATABASES and SHOW SETTINGS.
_READ_ROOTS = frozenset(
    {"SelectWithUnionQuery", "ShowTables", "ShowColumns", "DescribeQuery", "ExistsTableQuery", "ShowCreateTableQuery"}
)
# Query nodes that may appear anywhere below a read root.
_QUERY_NODES = _READ_ROOTS | {"SelectQuery", "SelectIntersectExceptQuery", "TablesInSelectQuery", "Explain"}
_EXPLAIN_KINDS = frozenset(
    {
        "EXPLAIN",
        "EXPLAIN AST",
        "EXPLAIN SYNTAX",
        "EXPLAIN QUERY TREE",
        "EXPLAIN PLAN",
        "EXPLAIN PIPELINE",
        "EXPLAIN ESTIMATE",
    }
)

TABLE_FUNCTIONS = frozenset(
    {"numbers", "numbers_mt", "zeros", "zeros_mt", "values", "generate_series", "generateseries", "view", "null"}
)
FORBIDDEN_FUNCTIONS = frozenset(
    {
        "file",
        "sleep",
        "sleepeachrow",
        "catboostevaluate",
        "addresstoline",
        "addresstolinewithinlines",
        "addresstosymbol",
        "demangle",
        "getmacro",
        "getserversetting",
    }
)
SYSTEM_TABLES = frozenset(
    {
        "tables",
        "columns",
        "databases",
        "parts",
        "parts_columns",
        "one",
        "functions",
        "table_functions",
        "formats",
        "data_type_families",
        "settings",
        "merges",
        "mutations",
        "metrics",
        "events",
        "asynchronous_metrics",
        "numbers",
        "numbers_mt",
        "zeros",
        "contributors",
    }
)
OUTPUT_FORMAT = re.compile(r"^[A-Za-z][A-Za-z0-9]{0,63}$")

_NODE = re.compile(r"^(?P<indent> *)(?P<name>\S+)(?: (?P<arg>.*?))?(?: \(children \d+\))?$")
_ALIAS = re.compile(r" \(alias [^)]*\)$")


@dataclass
class AstNode:
    """One line of ClickHouse's ``EXPLAIN AST`` dump: ``name`` (the node type) and ``arg`` (what follows it)."""

    name: str
    arg: str
    children: list[AstNode] = field(default_factory=list)
    parent: AstNode | None = field(default=None, repr=False)

    def walk(self) -> Iterator[AstNode]:
        yield self
        for child in self.children:
            yield from child.walk()

    @property
    def subject(self) -> str:
        """``arg`` without the ``(alias x)`` suffix: a function's or a table's name."""
        return _ALIAS.sub("", self.arg).strip()


@dataclass(frozen=True)
class ReadStatement:
    """A statement that passed: ``sql`` is the engine's canonical text (FORMAT included, if the query has one)."""

    sql: str
    output_format: str | None
    kind: str


def parse_ast_dump(text: str) -> AstNode:
    """The tree of an ``EXPLAIN AST`` dump (one node a line, one space of indent a level)."""
    stack: list[tuple[int, AstNode]] = []
    root: AstNode | None = None
    for line in text.splitlines():
        if not line.strip():
            continue
        match = _NODE.match(line)
        if match is None:
            raise ReadOnlyError(f"cannot read the engine's syntax tree at {line!r}")
        depth = len(match["indent"])
        node = AstNode(match["name"], match["arg"] or "")
        while stack and stack[-1][0] >= depth:
            stack.pop()
        if stack:
            node.parent = stack[-1][1]
            node.parent.children.append(node)
        elif root is None:
            root = node
        else:
            raise ReadOnlyError("the statement parses to more than one tree")
        stack.append((depth, node))
    if root is None:
        raise ReadOnlyError("empty statement")
    return root


def check_read(
    sql: str, *, format_query: Callable[[str], str], explain_ast: Callable[[str], str], database: str
) -> ReadStatement:
    """Parse ``sql`` with the engine (``format_query``, ``explain_ast``) and allow it only if it is a read.

    ``format_query`` answers ``formatQuerySingleLine(sql)`` and raises on a syntax error or a second
    statement; ``explain_ast`` answers the ``EXPLAIN AST`` dump of a statement.
    """
    if not sql.strip():
        raise ReadOnlyError("empty statement: send one SELECT")
    formatted = format_query(sql).strip()
    root = parse_ast_dump(explain_ast(formatted))
    output_format = _own_format(root, formatted)
    check_tree(root, database=database)
    return ReadStatement(formatted, output_format, root.name)


def check_tree(root: AstNode, *, database: str) -> None:
    """Raise :class:`ReadOnlyError` unless the tree is a read under the rules of the module docstring."""
    _check_root(root)
    for node in root.walk():
        if node.name == "Set":
            raise ReadOnlyError("SETTINGS are not accepted here: reads run with fixed limits")
        if node.name.endswith("Query") and node.name not in _QUERY_NODES:
            raise ReadOnlyError(f"only reads are allowed here, not {node.name}")
        if node.name == "Explain":
            _check_explain(node)
        elif node.name == "Function":
            _check_function(node)
        elif node.name == "TableIdentifier":
            _check_table(node.subject, database)


def _check_root(root: AstNode) -> None:
    if root.name == "Explain":
        return  # its query is checked by _check_explain during the walk
    if root.name not in _READ_ROOTS:
        raise ReadOnlyError(
            f"only reads are allowed here (SELECT, WITH ... SELECT, SHOW, DESCRIBE, EXISTS, EXPLAIN), not {root.name}"
        )
    _check_no_outfile(root)


def _check_no_outfile(query: AstNode) -> None:
    """A SELECT's root holds its body, then INTO OUTFILE's literals, then its FORMAT identifier."""
    if query.name != "SelectWithUnionQuery":
        return
    extra = query.children[1:]
    if extra and extra[-1].name == "Identifier":
        extra = extra[:-1]
    if extra:
        raise ReadOnlyError("INTO OUTFILE is not allowed here: results come back in the answer")


def _check_explain(node: AstNode) -> None:
    if node.arg not in _EXPLAIN_KINDS:
        raise ReadOnlyError(f"{node.arg} is not allowed here; allowed: {', '.join(sorted(_EXPLAIN_KINDS))}")
    queries = [child for child in node.children if child.name != "Identifier"]
    if len(queries) != 1 or queries[0].name not in _READ_ROOTS:
        raise ReadOnlyError("EXPLAIN is allowed here only of a read (SELECT, SHOW, DESCRIBE)")
    _check_no_outfile(queries[0])


def _check_function(node: AstNode) -> None:
    name = node.subject.lower()
    if node.parent is not None and node.parent.name == "TableExpression":
        if name not in TABLE_FUNCTIONS:
            raise ReadOnlyError(
                f"table function {node.subject} is not allowed here (it can reach files, URLs, other servers or "
                f"programs); allowed: {', '.join(sorted(TABLE_FUNCTIONS))}"
            )
    elif name in FORBIDDEN_FUNCTIONS:
        raise ReadOnlyError(f"function {node.subject} is not allowed here")


def _check_table(name: str, database: str) -> None:
    qualifier, dot, table = name.partition(".")
    if not dot:
        return
    qualifier, table = qualifier.strip('`"'), table.strip('`"')
    if qualifier == database or (qualifier == "system" and table in SYSTEM_TABLES):
        return
    raise ReadOnlyError(
        f"table {name} is not readable here: query Fulmen's database {database} "
        f"(or system.{{{', '.join(sorted(SYSTEM_TABLES))}}})"
    )


def _own_format(root: AstNode, formatted: str) -> str | None:
    """The query's own FORMAT: the tree's last identifier when the canonical text ends with it.

    (The engine's client appends its own FORMAT to the EXPLAIN when the query has none; that one is not in
    the text.)
    """
    query = root.children[0] if root.name == "Explain" and root.children else root
    for candidate in (root, query):
        if candidate.children and candidate.children[-1].name == "Identifier":
            name = candidate.children[-1].arg
            if formatted.endswith(f" FORMAT {name}"):
                if not OUTPUT_FORMAT.match(name):
                    raise ReadOnlyError(f"unknown output format {name!r}")
                return name
    return None

"""The `sql` task: answer questions about a small shop by querying its SQLite database.

Every question comes from one template filled with entity names copied from
the database, and its gold SQL is the same template filled with the same
names, so the query is a simple function of the question text that a small
model can learn. The gold answer is whatever the gold SQL returns on the real
database; combinations whose result is empty or NULL are not items. Each
(template, entities) combination is one item, split by a hash of its question.
"""

from __future__ import annotations

import re
import sqlite3
from dataclasses import dataclass
from itertools import product
from pathlib import Path
from typing import Any

from miniverl.engine.tasks.base import (SPLITS, ItemPool, Task, TaskItem, Tool, ToolCall, ToolResult, Transcript,
                                       Verdict, hash_split)
from miniverl.engine.tasks.protocol import strip_thinking
from miniverl.engine.tasks.sql_db import (CUSTOMER_NAMES, MAX_ROWS, PRODUCTS, SCHEMA_TEXT, YEARS, ReadOnlySql,
                                         database_path, read_only_uri, render_value)

_ORDERS_OF = "SELECT COUNT(*) FROM orders JOIN customers ON customers.id = orders.customer_id WHERE customers.name = '{c}'"
_UNITS_OF = ("SELECT SUM(orders.quantity) FROM orders JOIN products ON products.id = orders.product_id "
             "WHERE products.name = '{p}'")


@dataclass(frozen=True)
class Template:
    question: str
    sql: str
    slots: str  # which entities fill it: c customer, p product, y year


TEMPLATES = (
    Template("Which city does {c} live in?", "SELECT city FROM customers WHERE name = '{c}'", "c"),
    Template("How many orders did {c} place?", _ORDERS_OF, "c"),
    Template("How many orders did {c} place in {y}?", _ORDERS_OF + " AND orders.year = {y}", "cy"),
    Template("What is the price of the {p}?", "SELECT price FROM products WHERE name = '{p}'", "p"),
    Template("How many units of the {p} were sold in {y}?", _UNITS_OF + " AND orders.year = {y}", "py"),
    Template("How many units of the {p} did {c} buy?",
             "SELECT SUM(orders.quantity) FROM orders JOIN customers ON customers.id = orders.customer_id "
             "JOIN products ON products.id = orders.product_id WHERE customers.name = '{c}' AND products.name = '{p}'",
             "cp"),
)
_ENTITIES: dict[str, tuple[str, ...]] = {
    "c": CUSTOMER_NAMES,
    "p": tuple(name for name, _ in PRODUCTS),
    "y": tuple(str(y) for y in YEARS),
}
_NUMBER_RE = re.compile(r"[-+]?(\d+(\.\d*)?|\.\d+)")


class SqlTool(Tool):
    name = "sql"
    description = (f"Run one read-only SQLite SELECT query on the shop database and get back at most {MAX_ROWS} "
                   f"rows, columns joined by ' | '. {SCHEMA_TEXT}")
    parameters: dict[str, Any] = {
        "type": "object",
        "properties": {"query": {"type": "string", "description": "one SQLite SELECT statement"}},
        "required": ["query"],
        "additionalProperties": False,
    }

    def __init__(self, db: Path | None = None) -> None:
        self._sandbox = ReadOnlySql(db)  # opens nothing until the first query

    def run(self, arguments: dict[str, Any]) -> ToolResult:
        return self._sandbox.run(arguments["query"])

    def close(self) -> None:
        self._sandbox.close()


class SqlTask(Task):
    """Construction touches no file: the database is found (or built) on the first item or tool call."""

    name = "sql"

    def __init__(self, db: Path | None = None) -> None:
        self._db = db
        self._items: ItemPool | None = None
        self.tools = (SqlTool(db),)

    def capacity(self, split: str) -> int:
        return len(self._pool().by_split.get(split, []))

    def items(self, split: str, count: int, seed: int) -> list[TaskItem]:
        return self._pool().draw(self, split, count, seed)  # `draw` refuses a count past capacity

    def judge(self, item: TaskItem, transcript: Transcript) -> Verdict:
        calls, results = transcript.all_calls, transcript.all_results
        answer = final_answer(transcript.final_text)
        cells = [cell for r in results if r.ok for cell in result_cells(r.text)]
        checks = (
            ("tool_called", bool(calls)),
            ("format_valid", bool(calls) and all(c.error is None for c in calls)),
            ("query_succeeded", any(r.ok for r in results)),
            ("result_used", answer is not None and any(same_answer(answer, cell) for cell in cells)),
            ("correct", transcript.finished and answer is not None and same_answer(answer, item.answer)),
        )
        return Verdict(checks)

    def _pool(self) -> ItemPool:
        """Every item, built once: the gold SQL is ours, so it runs on a plain read-only connection."""
        if self._items is None:
            conn = sqlite3.connect(read_only_uri(self._db or database_path()), uri=True)
            try:
                everything = [_item(conn, t, fill) for t in TEMPLATES for fill in _fills(t)]
            finally:
                conn.close()
            found = sorted((i for i in everything if i is not None), key=lambda i: i.question)
            pool = ItemPool()
            for split in SPLITS:
                chosen = [i for i in found if hash_split(i.question) == split]
                pool.by_split[split] = [TaskItem(f"sql-{split}-{n:05d}", i.question, i.answer, i.reference_calls)
                                        for n, i in enumerate(chosen)]
            self._items = pool
        return self._items


def _fills(template: Template) -> list[dict[str, str]]:
    return [dict(zip(template.slots, values)) for values in product(*(_ENTITIES[s] for s in template.slots))]


def _item(conn: sqlite3.Connection, template: Template, fill: dict[str, str]) -> TaskItem | None:
    """The item for one filling, or None when the gold SQL finds nothing to answer."""
    sql = template.sql.format(**fill)
    rows = conn.execute(sql).fetchall()
    if len(rows) != 1 or rows[0][0] is None:
        return None
    return TaskItem("", template.question.format(**fill), render_value(rows[0][0]),
                    (ToolCall("sql", {"query": sql}),))


def final_answer(text: str | None) -> str | None:
    """What follows the last 'answer is' (or the whole text), thinking and a trailing period removed."""
    if text is None:
        return None
    text = strip_thinking(text)
    at = text.lower().rfind("answer is")
    answer = (text[at + len("answer is"):].lstrip(" :") if at >= 0 else text).strip()
    answer = answer[:-1].rstrip() if answer.endswith(".") else answer
    return answer or None


def result_cells(text: str) -> list[str]:
    """Every cell of a rendered result, header and notes left out."""
    rows = [line for line in text.split("\n")[1:] if not (line.startswith("(truncated") or line == "(no rows)")]
    return [cell for line in rows for cell in line.split(" | ")]


def same_answer(a: str, b: str) -> bool:
    """Case and spacing do not matter; numbers compare as numbers ("12" is "12.0")."""
    a, b = " ".join(a.split()).casefold(), " ".join(b.split()).casefold()
    if _NUMBER_RE.fullmatch(a) and _NUMBER_RE.fullmatch(b):
        return float(a) == float(b)
    return a == b

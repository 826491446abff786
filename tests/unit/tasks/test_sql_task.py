"""The `sql` task: disjoint deterministic splits, gold answers checked independently, and the strict judge."""

from __future__ import annotations

import re
import sqlite3
from collections import defaultdict
from pathlib import Path

import pytest

from miniverl.engine.tasks.base import TaskError, TaskItem, ToolCall, ToolResult, Transcript, hash_split
from miniverl.engine.tasks.protocol import tool_call_text
from miniverl.engine.tasks.sql import SqlTask, final_answer, same_answer
from miniverl.engine.tasks.sql_db import SCHEMA_TEXT, build_database


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("sqltask") / "shop.sqlite"
    build_database(path)
    return path


@pytest.fixture(scope="module")
def task(db: Path):
    task = SqlTask(db)
    yield task
    task.close()


def everything(task: SqlTask, split: str) -> list[TaskItem]:
    return task.items(split, task.capacity(split), seed=0)


def test_construction_touches_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("MINIVERL_CACHE", str(tmp_path / "cache"))
    task = SqlTask()
    task.close()
    assert not (tmp_path / "cache").exists()
    assert task.tool_schemas()[0]["function"]["parameters"] == {
        "type": "object", "properties": {"query": {"type": "string", "description": "one SQLite SELECT statement"}},
        "required": ["query"], "additionalProperties": False}
    assert SCHEMA_TEXT in task.tool_schemas()[0]["function"]["description"]


def test_splits_are_disjoint_and_follow_the_hash(task: SqlTask):
    train, heldout = everything(task, "train"), everything(task, "heldout")
    assert len(train) > 400 and len(heldout) >= 64
    assert {i.question for i in train}.isdisjoint({i.question for i in heldout})
    assert all(hash_split(i.question) == "train" for i in train)
    assert all(hash_split(i.question) == "heldout" for i in heldout)
    assert len({i.question for i in train}) == len(train)


def test_items_are_deterministic_in_the_seed(task: SqlTask, db: Path):
    assert task.items("train", 50, seed=3) == SqlTask(db).items("train", 50, seed=3)
    assert task.items("train", 50, seed=3) != task.items("train", 50, seed=4)
    ids = sorted(i.task_id for i in everything(task, "heldout"))
    assert ids == [f"sql-heldout-{n:05d}" for n in range(task.capacity("heldout"))]
    by_id = {i.task_id: i.question for i in everything(task, "heldout")}
    assert [by_id[k] for k in ids] == sorted(by_id.values())  # the id is the index in the sorted split


def test_capacity_is_respected(task: SqlTask):
    assert len(task.items("heldout", task.capacity("heldout"), seed=1)) == task.capacity("heldout")
    with pytest.raises(TaskError):
        task.items("heldout", task.capacity("heldout") + 1, seed=1)
    with pytest.raises(TaskError):
        task.items("test", 1, seed=1)


def _independent_answers(db: Path) -> dict[str, str]:
    """Every question's answer, from the raw tables in plain Python (no SQL beyond SELECT *)."""
    conn = sqlite3.connect(db)
    customers = {i: (name, city) for i, name, city in conn.execute("SELECT * FROM customers")}
    products = {i: (name, price) for i, name, _, price in conn.execute("SELECT * FROM products")}
    orders = [(customers[c][0], products[p][0], q, y) for _, c, p, q, y in conn.execute("SELECT * FROM orders")]
    conn.close()
    answers: dict[str, str] = {}
    counts: dict[tuple, int] = defaultdict(int)
    units: dict[tuple, int] = defaultdict(int)
    for name, city in customers.values():
        answers[f"Which city does {name} live in?"] = city
        counts[name] += 0
        for year in {y for *_, y in orders}:
            counts[name, year] += 0
    for name, price in products.values():
        answers[f"What is the price of the {name}?"] = str(price)
    for customer, product, quantity, year in orders:
        counts[customer] += 1
        counts[customer, year] += 1
        units[product, year] += quantity
        units[product, customer] += quantity
    for key, n in counts.items():
        question = f"How many orders did {key} place?" if isinstance(key, str) else \
            f"How many orders did {key[0]} place in {key[1]}?"
        answers[question] = str(n)
    for (product, other), n in units.items():
        question = f"How many units of the {product} were sold in {other}?" if isinstance(other, int) else \
            f"How many units of the {product} did {other} buy?"
        answers[question] = str(n)
    return answers


def test_gold_answers_match_an_independent_computation(task: SqlTask, db: Path):
    expected = _independent_answers(db)
    items = everything(task, "train") + everything(task, "heldout")
    assert {i.question for i in items} == set(expected)  # nothing missing, nothing empty or NULL kept
    for item in items:
        assert same_answer(item.answer, expected[item.question]), item
    templates = {re.sub(r"[A-Z][a-z]+|\d{4}", "_", i.question) for i in items}
    assert 4 <= len(templates) <= 6


def test_reference_calls_answer_through_the_tool(task: SqlTask):
    for item in task.items("heldout", 20, seed=2):
        (call,) = item.reference_calls
        result = task.run_call(task.check_call(call))
        assert result.ok and result.text.split("\n")[1] == item.answer
        assert task.judge(item, _transcript(call, result, task.final_answer_text(item.answer))).strict_success


def _transcript(call: ToolCall, result: ToolResult, final: str, finished: bool = True) -> Transcript:
    first = tool_call_text(call.name or "", call.arguments or {})
    return Transcript((first, final), ((call,), ()), ((result,), ()), finished)


ITEM = TaskItem("sql-train-00000", "Which city does Alice live in?", "Paris",
                (ToolCall("sql", {"query": "SELECT city FROM customers WHERE name = 'Alice'"}),))
GOOD_CALL = ITEM.reference_calls[0]
GOOD_RESULT = ToolResult("city\nParis", True)


def _checks(task: SqlTask, transcript: Transcript) -> dict[str, bool]:
    verdict = task.judge(ITEM, transcript)
    assert [name for name, _ in verdict.checks] == ["tool_called", "format_valid", "query_succeeded",
                                                     "result_used", "correct"]
    return dict(verdict.checks)


def test_judge_success(task: SqlTask):
    assert all(_checks(task, _transcript(GOOD_CALL, GOOD_RESULT, "The answer is Paris.")).values())
    thinking = "<think>the answer is Rome</think>I looked it up: the answer is  paris .<|im_end|>"
    assert all(_checks(task, _transcript(GOOD_CALL, GOOD_RESULT, thinking)).values())


def test_judge_wrong_answer_from_a_result(task: SqlTask):
    result = ToolResult("city\nRome", True)
    checks = _checks(task, _transcript(GOOD_CALL, result, "The answer is Rome."))
    assert checks["result_used"] and not checks["correct"]


def test_judge_answer_not_from_a_result(task: SqlTask):
    result = ToolResult("city\nRome | Oslo\n(truncated: more than 20 rows)", True)
    checks = _checks(task, _transcript(GOOD_CALL, result, "The answer is Paris."))
    assert checks["query_succeeded"] and checks["correct"] and not checks["result_used"]
    failed = _checks(task, _transcript(GOOD_CALL, ToolResult("error: no such table: x", False), "Paris"))
    assert not failed["query_succeeded"] and not failed["result_used"]


def test_judge_no_tool_call(task: SqlTask):
    checks = _checks(task, Transcript(("The answer is Paris.",), ((),), ((),), True))
    assert checks == {"tool_called": False, "format_valid": False, "query_succeeded": False,
                      "result_used": False, "correct": True}


def test_judge_malformed_call(task: SqlTask):
    bad = task.check_call(ToolCall("sql", {"sql": "SELECT 1"}))
    assert bad.error is not None
    mixed = Transcript(("<tool_call>x</tool_call>", "The answer is Paris."), ((bad, GOOD_CALL), ()),
                       ((task.run_call(bad), GOOD_RESULT), ()), True)
    checks = _checks(task, mixed)
    assert checks["tool_called"] and not checks["format_valid"] and checks["correct"]


def test_judge_unfinished(task: SqlTask):
    checks = _checks(task, _transcript(GOOD_CALL, GOOD_RESULT, "The answer is Paris", finished=False))
    assert checks["result_used"] and not checks["correct"]
    cut = Transcript((tool_call_text("sql", GOOD_CALL.arguments),), ((GOOD_CALL,),), ((GOOD_RESULT,),), False)
    assert not _checks(task, cut)["result_used"]  # no final text at all


def test_final_answer_and_comparison():
    assert final_answer(None) is None
    assert final_answer("The answer is 12.") == "12"
    assert final_answer("So the answer is: 12.5.") == "12.5"
    assert final_answer("<think>answer is 3</think>Paris") == "Paris"
    assert same_answer("12", "12.0") and same_answer("New  York", "new york")
    assert not same_answer("12", "12.5") and not same_answer("Paris", "Pari")

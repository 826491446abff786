"""Hostile SQL written by the model goes through the real tool loop: refused or cut off, the episode goes on."""

from __future__ import annotations

import time

from support import drive_by_hand
from miniverl.engine.rollout.loop import Budget, ToolLoop
from miniverl.engine.tasks.base import ToolCall
from miniverl.engine.tasks.protocol import END_OF_TURN, assistant_turn_text
from miniverl.engine.tasks.sql import SqlTask
from miniverl.engine.tasks.sql_db import database_path, file_sha256
from miniverl.engine.tiny.models import FAMILIES, load_tokenizer

HOSTILE = [
    "DROP TABLE customers",
    "ATTACH DATABASE '/tmp/evil.db' AS evil",
    "PRAGMA writable_schema=1",
    "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x+1 FROM c) SELECT count(*) FROM c",
    "SELECT count(*) FROM orders a, orders b, orders c, orders d",
    "SELECT printf('%.*c', 1000000, 'x')",
]


def test_hostile_queries_are_tool_errors_and_the_episode_goes_on():
    task = SqlTask()
    item = task.items("heldout", 1, seed=0)[0]
    before = file_sha256(database_path())
    tokenizer = load_tokenizer(family=FAMILIES["sql"])
    loop = ToolLoop(tokenizer, task, Budget(max_turns=4, max_new_tokens_per_turn=2000, max_total_tokens=8000))
    hostile = assistant_turn_text("", [ToolCall("sql", {"query": q}) for q in HOSTILE]) + END_OF_TURN
    gold = assistant_turn_text("", item.reference_calls) + END_OF_TURN
    started = time.perf_counter()
    episode = drive_by_hand(loop, item, [hostile, gold, task.final_answer_text(item.answer) + END_OF_TURN])
    assert time.perf_counter() - started < 10  # each runaway query is cut by its own 0.5 s budget
    first = episode.results[0]
    assert len(first) == len(HOSTILE)
    assert not any(r.ok for r in first[:5]), [r.text for r in first]
    assert all(r.text.startswith("error:") for r in first[:5])
    assert len(first[5].text) < 4096  # the 1 MB string never reaches the model
    assert episode.finish_reason == "stop" and episode.verdict().strict_success
    assert file_sha256(database_path()) == before
    task.close()

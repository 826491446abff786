import pytest

from miniverl.engine.tasks import calculator as T
from miniverl.engine.tasks.base import TaskError, TaskItem, ToolCall, ToolResult, Transcript
from miniverl.engine.tasks.protocol import parse_tool_calls, tool_call_text

CALC = T.CalculatorTask()


def test_splits_are_disjoint_and_deterministic():
    train = CALC.items("train", 500, seed=3)
    heldout = CALC.items("heldout", 200, seed=3)
    assert {T.expression_of(t) for t in train}.isdisjoint({T.expression_of(t) for t in heldout})
    assert all(T.split_of(T.expression_of(t)) == "heldout" for t in heldout)
    assert CALC.items("train", 500, seed=3) == train
    for t in heldout:
        assert str(eval(T.expression_of(t))) == t.answer  # test-only oracle  # noqa: S307


def test_a_small_operand_range_has_a_small_exact_capacity():
    small = T.CalculatorTask(operand_max=10)  # 10+10, 10-10, 10*10 only
    assert small.capacity("train") + small.capacity("heldout") == 3
    with pytest.raises(TaskError, match="distinct"):
        small.items("heldout", 64, seed=0)


def test_calls_are_checked_against_the_tool_schema():
    good = parse_tool_calls(tool_call_text("calculator", {"expression": "12*3"}) + "<|im_end|>")
    assert [CALC.check_call(c) for c in good] == [ToolCall("calculator", {"expression": "12*3"})]
    wrong_name = CALC.check_call(parse_tool_calls(tool_call_text("calc", {"expression": "1"}))[0])
    assert not wrong_name.well_formed and "unknown tool" in wrong_name.error
    extra_key = CALC.check_call(parse_tool_calls(tool_call_text("calculator", {"expr": "1"}))[0])
    assert not extra_key.well_formed
    assert CALC.run_call(extra_key) == ToolResult("error: malformed tool call", False)
    assert CALC.run_call(good[0]) == ToolResult("36", True)


def _verdict(turns, results, finished=True):
    item = TaskItem("t", "What is 12*3?", "36", (ToolCall("calculator", {"expression": "12*3"}),))
    calls = tuple(tuple(CALC.check_call(c) for c in parse_tool_calls(t)) for t in turns)
    grouped, it = [], iter(results)
    for turn_calls in calls:
        grouped.append(tuple(ToolResult(*next(it)) for _ in turn_calls))
    return CALC.judge(item, Transcript(tuple(turns), calls, tuple(grouped), finished))


def test_judge_requires_every_strict_condition():
    call = tool_call_text("calculator", {"expression": "12*3"}) + "<|im_end|>"
    assert _verdict([call, "The answer is 36.<|im_end|>"], [("36", True)]).strict_success
    # answered directly: right number, no tool
    assert not _verdict(["The answer is 36.<|im_end|>"], []).strict_success
    # tool called but result not used
    assert not _verdict([call, "The answer is 35.<|im_end|>"], [("36", True)]).strict_success
    # wrong expression: result used, but wrong
    wrong = tool_call_text("calculator", {"expression": "12*4"}) + "<|im_end|>"
    v = _verdict([wrong, "The answer is 48.<|im_end|>"], [("48", True)])
    assert v["result_used"] and not v["correct"] and not v.strict_success
    # invalid expression
    bad = tool_call_text("calculator", {"expression": "12*"}) + "<|im_end|>"
    assert not _verdict([bad, "The answer is 36."], [("error: invalid expression", False)]).strict_success
    # never finished
    assert not _verdict([call, "The answer is 36"], [("36", True)], finished=False).strict_success

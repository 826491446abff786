from miniverl.engine.tasks import calculator as T


def test_splits_are_disjoint_and_deterministic():
    train = T.make_tasks("train", 500, seed=3)
    heldout = T.make_tasks("heldout", 200, seed=3)
    assert {t.expression for t in train}.isdisjoint({t.expression for t in heldout})
    assert all(T.split_of(t.expression) == "heldout" for t in heldout)
    assert T.make_tasks("train", 500, seed=3) == train
    for t in heldout:
        assert eval(t.expression) == t.answer  # test-only oracle  # noqa: S307


def test_parse_tool_calls_is_strict():
    good = T.tool_call_text("12*3") + "<|im_end|>"
    assert T.parse_tool_calls(good) == [T.ToolCall(True, "12*3")]
    assert T.parse_tool_calls('<tool_call>\n{"name": "calc", "arguments": {"expression": "1"}}\n</tool_call>')[0].well_formed is False
    assert T.parse_tool_calls('<tool_call>\n{"name": "calculator", "arguments": {"expr": "1"}}\n</tool_call>')[0].well_formed is False
    assert T.parse_tool_calls("<tool_call>\n{not json}\n</tool_call>")[0].well_formed is False
    assert T.parse_tool_calls("<tool_call>\n{\"name\": ") == [T.ToolCall(False, None)]
    assert T.parse_tool_calls("The answer is 5.") == []


def _verdict(turns, results, finished=True):
    task = T.CalcTask("t", "What is 12*3?", "12*3", 36)
    return T.judge(task, turns, results, finished)


def test_judge_requires_every_strict_condition():
    call = T.tool_call_text("12*3") + "<|im_end|>"
    assert _verdict([call, "The answer is 36.<|im_end|>"], [("36", True)]).strict_success
    # answered directly: right number, no tool
    assert not _verdict(["The answer is 36.<|im_end|>"], []).strict_success
    # tool called but result not used
    assert not _verdict([call, "The answer is 35.<|im_end|>"], [("36", True)]).strict_success
    # wrong expression: result used, but wrong
    wrong = T.tool_call_text("12*4") + "<|im_end|>"
    v = _verdict([wrong, "The answer is 48.<|im_end|>"], [("48", True)])
    assert v.result_used and not v.correct and not v.strict_success
    # invalid expression
    assert not _verdict([T.tool_call_text("12*") + "<|im_end|>", "The answer is 36."], [("error: invalid expression", False)]).strict_success
    # never finished
    assert not _verdict([call, "The answer is 36"], [("36", True)], finished=False).strict_success

"""tool_call_reward (calculator and increment_env recipes): only a parsed tool call earns it.

Completions are built the way the tool loop builds them: each reply parsed by `parse_assistant_reply`
(Qwen3/Hermes format), each parsed call run by `run_tool_call` against the recipe's tool, its result appended
as a ``tool`` message.
"""

import asyncio

from asyncgrpo_cli.envs.calculator import calculate
from asyncgrpo_cli.envs.increment import tool_call_reward
from asyncgrpo_cli.rollout.tools import ToolBox, parse_assistant_reply, run_tool_call


def rollout(*replies, run=True):
    toolbox = ToolBox([calculate])
    completion = []
    for text in replies:
        reply = parse_assistant_reply(text)
        completion.append(reply.message)
        for call in reply.calls if run else []:
            result = asyncio.run(run_tool_call(call, toolbox, None, 10.0))
            message = {"role": "tool", "content": result.content}
            if result.name is not None:
                message["name"] = result.name
            completion.append(message)
    return completion


CALL = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "%s"}}\n</tool_call>'


def test_mentioning_the_tool_earns_nothing():
    # Every calculator prompt starts with "Calculate ...": the word alone used to earn 0.1.
    completions = [
        rollout("To calculate 12 + 30, I use calculate. The answer is 42."),
        rollout("calculate(12 + 30)"),
        rollout("<tool_call>calculate 12 + 30</tool_call>"),  # malformed: not a parsed call
        rollout('<tool_call>\n{"name": "calc", "arguments": {"expression": "1+1"}}\n</tool_call>'),  # another tool
    ]
    assert tool_call_reward(completions, tool_names=["calculate"]) == [0.0, 0.0, 0.0, 0.0]


def test_parsed_calls_earn_the_reward():
    ran = rollout(CALL % "12 + 30", "The answer is 42.")
    failed = rollout(CALL % "12 +", "The answer is 42.")  # parsed, but the tool raised
    not_run = rollout(CALL % "12 + 30", run=False)  # parsed, past max_tool_calling_iterations
    assert ran[1] == {"role": "tool", "content": "42", "name": "calculate"}
    assert failed[1]["content"].startswith("Error")
    assert tool_call_reward([ran, failed, not_run], tool_names=["calculate"]) == [0.5, 0.2, 0.2]

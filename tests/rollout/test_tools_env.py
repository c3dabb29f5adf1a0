"""Environments in the real rollout loop (SPEC §13.2, §15.5, Appendix B.2): reset/get_reward, tools from
methods, dict routing, failures of an environment hook, environment-owned data through the trainer."""

from __future__ import annotations

import json
import random

import datasets
import pytest

from asyncgrpo_cli.rollout.environments import EnvironmentOwnedPrompts, compose_prompt, route_environment
from test_tools import Harness, call, make_tiny_tokenizer, responses  # noqa: F401 - shared harness


class CounterEnv:
    """Environment with a reward and one tool."""

    instances = 0

    def __init__(self):
        type(self).instances += 1
        self.counter = 0
        self.target = 0

    def reset(self, target=None, **kwargs):
        self.counter = 0
        self.target = int(target) if target is not None else 2
        return None if target is not None else "Reach 2."

    def get_reward(self) -> float:
        return float(self.counter == self.target)

    def increment(self, step: int) -> int:
        """Add to the counter.

        Args:
            step: amount.

        Returns:
            The counter.
        """
        self.counter += step
        return self.counter


class GameEnv:
    """A second environment with a different tool and no reward."""

    def reset(self, **kwargs):
        return " Move now."

    def move(self, action: str) -> str:
        """Move on the board.

        Args:
            action: up, down, left or right.

        Returns:
            The observation.
        """
        return f"moved {action}"


class BrokenEnv:
    """reset raises on odd episodes, get_reward on every third."""

    episodes = 0

    def reset(self, **kwargs):
        type(self).episodes += 1
        if type(self).episodes % 2 == 1:
            raise KeyError("no such level")
        return "Play."

    async def get_reward(self) -> float:
        return random.random()


def increment_script(prompt):
    n = responses(prompt)
    if n == 0:
        return call("increment", step=1) + "\n" + call("increment", step=1)
    return "done"


@pytest.fixture(scope="module")
def tokenizer():
    return make_tiny_tokenizer(tool_template=True)


@pytest.fixture
def harness(tokenizer):
    made = []

    def make(script, dataset, **kw):
        h = Harness(tokenizer, script, dataset, **kw)
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()


def test_environment_owns_prompt_tools_and_reward(harness, tokenizer):
    CounterEnv.instances = 0
    h = harness(increment_script, EnvironmentOwnedPrompts(), environment_factory=CounterEnv, reward_funcs=[],
                num_generations=4)
    outs = h.outcomes(3)
    assert all(o.kind == "dropped" for o in outs)  # every rollout reaches 2: reward 1 everywhere, no spread
    first = tokenizer.decode(h.server.prompts[0])
    assert "<|im_start|>user\nReach 2.<|im_end|>" in first and '"name": "increment"' in first
    assert '"reset"' not in first and "get_reward" not in first
    m = h.metrics()
    assert m["rewards/CounterEnv/mean"] == 1.0 and m["env/reset_s"] >= 0 and m["env/reward_s"] >= 0
    assert m["tools/increment/call_count"] >= 24
    assert CounterEnv.instances <= 8  # one per in-flight rollout, reused across episodes


def test_reset_text_is_appended_to_last_user_message():
    prompt = [{"role": "system", "content": "s"}, {"role": "user", "content": "Task."}]
    assert compose_prompt(prompt, " Extra.")[-1] == {"role": "user", "content": "Task. Extra."}
    assert compose_prompt(prompt, None) == prompt
    assert compose_prompt(None, "Go.") == [{"role": "user", "content": "Go."}]
    with pytest.raises(ValueError, match="reset\\(\\) returned None and the row has no 'prompt'"):
        compose_prompt([], None)


def test_dict_routing_shows_only_the_routed_environments_tools(harness, tokenizer):
    dataset = datasets.Dataset.from_list([
        {"prompt": [{"role": "user", "content": "counter task"}], "environment": "counter", "target": 1},
        {"prompt": [{"role": "user", "content": "game task"}], "environment": "game", "target": 0}])

    def script(prompt):
        return call("increment", step=1) if "counter task" in prompt and responses(prompt) == 0 else "done"

    h = harness(script, dataset, environment_factory={"counter": CounterEnv, "game": GameEnv},
                reward_funcs=[], num_generations=2)
    h.outcomes(2)
    seen = {"counter": 0, "game": 0}
    for ids in h.server.prompts:
        text = tokenizer.decode(ids)
        if "counter task" in text:
            seen["counter"] += 1
            assert '"name": "increment"' in text and '"name": "move"' not in text
        else:
            assert "game task Move now." in text  # B.2: appended to the last user message
            assert '"name": "move"' in text and '"name": "increment"' not in text
            seen["game"] += 1
    assert seen["counter"] and seen["game"]


def test_unknown_environment_name_is_a_clear_error():
    with pytest.raises(ValueError, match=r"'chess'.*known names are \['counter', 'game'\]"):
        route_environment({"counter": CounterEnv, "game": GameEnv}, {"environment": "chess"})
    with pytest.raises(ValueError, match="no 'environment' column"):
        route_environment({"counter": CounterEnv}, {"prompt": []})


def test_failing_reset_fails_only_that_rollout(harness, caplog):
    BrokenEnv.episodes = 0
    h = harness(lambda prompt: "fine", EnvironmentOwnedPrompts(), environment_factory=BrokenEnv, reward_funcs=[],
                num_generations=4)
    outs = h.outcomes(6)
    kept = [o for o in outs if o.kind == "kept"]
    assert kept  # the worker goes on; failed rollouts are unscored and give no sample
    assert sum(len(o.samples) for o in outs) < 4 * len(outs)
    m = h.metrics()
    assert m["env/failure_count"] >= 12 and "rewards/BrokenEnv/mean" in m


def test_trainer_refuses_no_dataset_without_max_steps(tmp_path):
    from asyncgrpo_cli import AsyncGRPOConfig, AsyncGRPOTrainer

    args = AsyncGRPOConfig(output_dir=str(tmp_path), report_to="none")
    with pytest.raises(ValueError, match="max_steps must be set"):
        AsyncGRPOTrainer(model="unused", args=args, environment_factory=CounterEnv)
    with pytest.raises(ValueError, match="train_dataset=None"):
        AsyncGRPOTrainer(model="unused", reward_funcs=[lambda **k: 0], args=args)
    with pytest.raises(ValueError, match=r"\['GameEnv'\] has no get_reward"):
        AsyncGRPOTrainer(model="unused", args=AsyncGRPOConfig(output_dir=str(tmp_path), report_to="none", max_steps=1),
                         environment_factory={"game": GameEnv, "counter": CounterEnv})


class CoinEnv:
    """Environment-owned data with a reward that has spread (the tiny model is random)."""

    def reset(self, **kwargs):
        return f"Flip {random.randint(0, 9)}."

    def get_reward(self) -> float:
        return float(random.random() < 0.5)

    def peek(self, side: str) -> str:
        """Look at the coin.

        Args:
            side: which side.

        Returns:
            What is seen.
        """
        return side


def test_environment_owned_data_trains_with_max_steps(tmp_path):
    from asyncgrpo_cli import AsyncGRPOConfig, AsyncGRPOTrainer
    from asyncgrpo_cli.sampler.embedded.server import ServerConfig, ServerThread
    from asyncgrpo_cli.testing import make_tiny_model

    model_dir = make_tiny_model(tmp_path / "tiny", tool_template=True)
    server = ServerThread(ServerConfig(model=str(model_dir), port=0, device="cpu", dtype="float32",
                                       max_model_len=512, max_logprobs=4)).start()
    try:
        args = AsyncGRPOConfig(output_dir=str(tmp_path / "run"), max_steps=2, num_generations=4,
                               max_completion_length=8, num_sampler_logprobs=2, vllm_server_base_url=server.url,
                               report_to="none", vllm_server_timeout=120.0, rollout_worker_timeout=120.0,
                               optim="sgd", save_steps=100, max_tool_calling_iterations=1)
        trainer = AsyncGRPOTrainer(model=str(model_dir), args=args, environment_factory=CoinEnv)
        result = trainer.train()
        assert result.global_step == 2
        lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
        merged = {k for line in lines for k in line}
        assert {"rewards/CoinEnv/mean", "env/reset_s", "env/reward_s", "tools/call_frequency",
                "tools/loop_exhausted_frac"} <= merged
        status = json.loads((tmp_path / "run" / "status.json").read_text())
        assert "epoch" not in merged and status.get("epoch") is None and status["num_train_epochs"] is None
    finally:
        server.stop()


def test_cli_groups_import_tools_and_environments():
    from asyncgrpo_cli.config.compose import compose, to_training_args
    from asyncgrpo_cli.config.rules import ConfigError
    from asyncgrpo_cli.envs.calculator import calculate
    from asyncgrpo_cli.envs.increment import IncrementEnv, IncrementEnvWithExample
    from asyncgrpo_cli.train.main import agent_objects

    from asyncgrpo_cli.imports import reward_functions
    from asyncgrpo_cli.rollout.reward_runner import check_picklable

    cfg = compose(["+recipe=calculator", "rollout.tool_call_timeout=2.5"])
    assert agent_objects(cfg) == ([calculate], None) and to_training_args(cfg).tool_call_timeout == 2.5
    for func in reward_functions(list(cfg.rewards)):  # list-valued kwargs (tool_names) must reach the worker
        check_picklable(func, "reward function")
    cfg = compose(["+recipe=increment_env"])
    assert agent_objects(cfg) == ([], IncrementEnvWithExample) and not cfg.data.name and not cfg.data.generator
    assert int(cfg.packing.token_budget) == int(cfg.sampler.max_model_len)  # no "samples may not fit" warning
    cfg = compose(["+recipe=increment_env", "environment.factory={a: asyncgrpo_cli.envs.increment:IncrementEnv}"],
                  validate=False)  # a dict without a dataset is refused by validation (test_environment_dict.py)
    assert agent_objects(cfg)[1] == {"a": IncrementEnv}
    with pytest.raises(ConfigError, match="environment.factory"):
        agent_objects(compose(["environment.factory=asyncgrpo_cli.envs.increment:Missing"]))
    assert calculate("(3 + 4) * 2") == "14" and calculate("7 / 2") == "3.5"
    with pytest.raises(ValueError, match="unsupported"):
        calculate("__import__('os')")


class BrokenLoop:
    """A loop class whose constructor raises (stands in for a bad subclass or argument)."""

    def __init__(self, **kwargs):
        raise ValueError("bad loop argument: max_tool_calling_iterations=-1")


def test_worker_that_fails_building_the_loop_reports_its_traceback(tmp_path):
    from asyncgrpo_cli import AsyncGRPOConfig
    from asyncgrpo_cli.rollout.worker import RolloutWorker, RolloutWorkerError

    args = AsyncGRPOConfig(output_dir=str(tmp_path), report_to="none", vllm_server_base_url="http://127.0.0.1:9")
    worker = RolloutWorker(args, "m", EnvironmentOwnedPrompts(), [], make_tiny_tokenizer(), [0], loop_cls=BrokenLoop)
    try:
        with pytest.raises(RolloutWorkerError, match="while building the rollout loop BrokenLoop(.|\n)*bad loop"):
            worker.start(ready_timeout_s=120)
    finally:
        worker.stop()


def test_the_example_task_shows_a_call_the_parser_reads():
    from asyncgrpo_cli.envs.increment import IncrementEnvWithExample
    from asyncgrpo_cli.rollout.tools import parse_assistant_reply

    env = IncrementEnvWithExample()
    task = env.reset()
    assert task.endswith(f"Now increment the counter by {env.target}.") and env.counter == 0
    shown = task[task.index("<tool_call>"):task.index("</tool_call>") + len("</tool_call>")]
    [call] = parse_assistant_reply(shown).calls
    assert call.error is None and call.name == "increment" and env.increment(**call.arguments) == 1
    assert env.reset(target=4) is None and env.target == 4  # a dataset row's prompt is used as it is

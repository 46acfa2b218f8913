"""skyrl-gym's text environments behind the multi-turn protocol (`environment: skyrl`; the `skyrl`
extra: `pip install 'jaxreplay[skyrl]'`).

Used through skyrl-gym's own API: `skyrl_gym.make(env_id, env_config=..., extras=...)`, then
`init(prompt)` for the first messages and `step(action)` -> {observations, reward, done, metadata}
per model turn. Its multi-turn GSM8K (`gsm8k_multi_turn`, the default) runs offline: it scores each
turn's `#### n` against the item's answer (1 when right, which ends the episode; a small format
score otherwise) and asks again until `max_turns`. Any task item with a question and an answer
serves (tools.item_question / item_answer).

Some skyrl-gym environments run the model's output as code (`lcb`, `searchcode`, `rlm`: a Python
subprocess or REPL with no sandbox). They are refused unless `allow_code_execution: true`
(docs/security.md). `search` and `text2sql` need a search server or downloaded databases.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from jaxreplay.tasks.environment import Message, Step, register_environment
from jaxreplay.tasks.tools import item_answer, item_question

# skyrl-gym 0.4.0's environments that execute model-written code without a sandbox.
CODE_EXECUTING = ("lcb", "searchcode", "rlm")
ROLES = ("system", "user", "tool")


def _messages(conversation: Any) -> tuple[Message, ...]:
    """skyrl-gym's OpenAI-style messages as ours (a role we do not render, e.g. "assistant", reads as user)."""
    return tuple(Message(m["role"] if m.get("role") in ROLES else "user", str(m.get("content", "")), m.get("name"))
                 for m in conversation or ())


class SkyRLEnvironment:
    """One skyrl-gym environment per episode, made fresh on each `reset` (skyrl-gym's envs take
    their item's ground truth at construction). `seed` is not used: the offline ones are
    deterministic."""

    def __init__(self, env: str = "gsm8k_multi_turn", *, max_turns: int = 4,
                 env_config: Optional[Mapping[str, Any]] = None, allow_code_execution: bool = False):
        try:
            import skyrl_gym
        except ImportError:
            raise ValueError("environment skyrl needs skyrl-gym: pip install 'jaxreplay[skyrl]'") from None
        if env not in skyrl_gym.registry:
            raise ValueError(f"skyrl-gym has no environment {env!r} (it has: {', '.join(sorted(skyrl_gym.registry))})")
        if env in CODE_EXECUTING and not allow_code_execution:
            raise ValueError(f"skyrl-gym's {env!r} runs model-written code with no sandbox: set "
                             "allow_code_execution: true only where that is safe (docs/security.md)")
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, not {max_turns}")
        self._make = skyrl_gym.make
        self.env_id = env
        self.max_turns = int(max_turns)
        self.env_config = dict(env_config or {})
        self.env: Any = None

    def reset(self, item: Any, seed: int) -> tuple[Message, ...]:
        if self.env is not None:
            self.env.close()
        truth = {"method": "rule", "ground_truth": item_answer(item)}
        extras = {"reward_spec": truth, "reward_model": truth, "extra_info": {"max_turns": self.max_turns},
                  "max_turns": self.max_turns}
        self.env = self._make(self.env_id, env_config=self.env_config, extras=extras)
        first, _ = self.env.init([{"role": "user", "content": item_question(item)}])
        return _messages(first)

    def step(self, turn_text: str) -> Step:
        out = self.env.step(turn_text)
        done = bool(out["done"])
        return Step(observation=() if done else _messages(out["observations"]), reward=float(out["reward"]),
                    done=done, info=dict(out.get("metadata") or {}))


register_environment("skyrl", SkyRLEnvironment)

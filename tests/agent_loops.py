"""Outside agent loops the agent-loop tests run (`environment.options.harness: agent_loops:guess_digit`):
plain Python clients of the trainer's endpoint, through the official OpenAI client."""

from __future__ import annotations

import threading

from jaxreplay.tasks.arithmetic import CharTokenizer

# What each episode's harness saw, by episode id: its final ids and which of them the engine drew
# (the model's) rather than the harness (its prompt, its answers), the log-probs it got back and how many calls were refused.
EPISODES: dict[str, dict] = {}
_LOCK = threading.Lock()
_CLIENTS: dict = {}


def _client(base_url: str):
    """One client per server, shared by its episodes (each call sends its own episode's header)."""
    import openai

    with _LOCK:
        if base_url not in _CLIENTS:
            _CLIENTS[base_url] = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
        return _CLIENTS[base_url]


def guess_digit(item, seed, endpoint, calls: int = 3, rerender_at: int = -1) -> float:
    """The demo's guess-the-digit game, played from outside: each model turn is a guess, the
    harness answers `+`/`-` with its own tokens, up to `calls` calls; reward 1 when a turn is the
    digit. `rerender_at`: that call first sends its prompt with an earlier model id changed (a
    client that re-rendered), expects a 409, then sends the true one."""
    import openai

    tok = CharTokenizer()
    client = _client(endpoint.base_url)
    ids = tok.encode(":")
    model, logprobs = [False] * len(ids), []
    reward, refused = 0.0, 0
    for call in range(calls):
        if call == rerender_at:
            bad = list(ids)
            k = model.index(True)  # the first model id, as a client re-tokenising text might change it
            bad[k] = tok.encode("9")[0] if bad[k] != tok.encode("9")[0] else tok.encode("8")[0]
            try:
                client.completions.create(model=endpoint.model, prompt=bad, extra_headers=endpoint.headers,
                                          extra_body={"return_token_ids": True})
            except openai.ConflictError:
                refused += 1
            else:
                raise AssertionError("a re-rendered prompt was served")
        choice = client.completions.create(model=endpoint.model, prompt=ids, logprobs=0, extra_headers=endpoint.headers,
                                           extra_body={"return_token_ids": True}).choices[0]
        turn = choice.model_extra["token_ids"]
        ids, model, logprobs = ids + turn, model + [True] * len(turn), logprobs + choice.logprobs.token_logprobs
        if choice.finish_reason != "stop":  # the episode's token budget ran out
            break
        text = tok.decode(turn)
        guess = int(text) if len(text) == 1 and text.isdigit() else -1
        if guess == int(item):
            reward = 1.0
            break
        if call + 1 < calls:  # the harness's own tokens, sent with its next call
            answer = tok.encode("+" if int(item) > guess else "-")
            ids, model = ids + answer, model + [False] * len(answer)
    with _LOCK:
        EPISODES[endpoint.episode_id] = {"ids": ids, "model": model, "logprobs": logprobs, "refused": refused,
                                         "reward": reward}
    return reward


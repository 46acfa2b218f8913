"""`jaxreplay serve` as a client sees it: the official `openai` client (and plain HTTP for vLLM's
token-in/token-out route) against a live server subprocess on 127.0.0.1, one per module.

The served model is a one-layer Qwen2-shaped model with a character tokenizer (tests/tiny_hf.py)
whose output head is set so that, greedy, after the assistant turn opens it writes the pythonic
tool call `[f(x=1)]` and ends its turn: a tool call that a random model would never write.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.needs_serve

ROOT = Path(__file__).resolve().parents[1]
CALL = "[f(x=1)]"
MAX_TOKENS, PROMPT_LEN = 128, 256
TOOLS = [{"type": "function", "function": {"name": "f", "description": "f of x",
                                           "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}}]


def write_served_model(path: Path) -> Path:
    """tiny_hf's model, untied, its head writing CALL then EOS after "t" (greedy)."""
    import jax.numpy as jnp
    from flax import nnx
    from tiny_hf import QWEN_TOOLS, WORDS, write_char_tokenizer

    from jaxreplay.config import ModelConfig
    from jaxreplay.models.hf import save_hf_model
    from jaxreplay.models.transformer import init_params

    cfg = ModelConfig(vocab_size=128, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, d_ff=64,
                      max_seq_len=PROMPT_LEN + MAX_TOKENS, attention_bias=True, tie_embeddings=False)
    _, params = init_params(cfg, 0)
    ids = {w: i for i, w in enumerate(WORDS)}
    chain = ["t", *CALL, "<|im_end|>"]  # the assistant turn opens with "...assistant": its last id is "t"
    embed = np.array(params["embed"]["embedding"][...])
    head = np.array(params["lm_head"]["kernel"][...])
    # The chain's tokens get orthogonal embeddings, long against the rest, and each one's successor a
    # head column along it: whatever attention adds, the residual keeps the token's direction.
    basis = np.linalg.qr(np.random.default_rng(0).normal(size=(embed.shape[1], len(chain))))[0].T
    scale = 5 * np.linalg.norm(embed, axis=1).mean()
    for k, (a, b) in enumerate(zip(chain, chain[1:])):
        embed[ids[a]] = scale * basis[k]
        head[:, ids[b]] += 3.0 * basis[k]
    params["embed"]["embedding"][...] = jnp.asarray(embed)
    params["lm_head"]["kernel"][...] = jnp.asarray(head)
    for name in ("o_proj",):  # attention and MLP stay, smaller: the residual keeps the token's direction
        params["layers"][0]["attn"][name]["kernel"][...] *= 0.1
    params["layers"][0]["mlp"]["down_proj"]["kernel"][...] *= 0.1
    save_hf_model(path, cfg, params)
    write_char_tokenizer(path, QWEN_TOOLS)
    (path.parent / "dev.jsonl").write_text(json.dumps({"q": "1+1=", "a": "2"}) + "\n")
    del nnx
    return path


class Live:
    """The module's server process; a test that ends it (SIGTERM) leaves the next one to start another."""

    def __init__(self, model: Path):
        self.model, self.process, self.url = model, None, None

    def command(self) -> list[str]:
        return [sys.executable, "-m", "jaxreplay", "serve", str(ROOT / "configs" / "demo.yaml"), "task.name=jsonl",
                f"task.path={self.model.parent}/{{split}}.jsonl", "task.prompt_field=q", "task.answer_field=a",
                "task.chat_template=true", f"task.max_prompt_len={PROMPT_LEN}", "warmstart.steps=0",
                f"sampling.max_new_tokens={MAX_TOKENS}", f"model.max_seq_len={PROMPT_LEN + MAX_TOKENS}",
                "--hf", str(self.model), "--port", "0", "--slots", "8", "--tool-call-format", "pythonic",
                "--model-name", "tiny", "--grace-s", "20"]

    def get(self) -> str:
        if self.process is not None and self.process.poll() is None:
            return self.url
        env = {**os.environ, "JAX_PLATFORMS": "cpu"}
        env.pop("JAXREPLAY_SERVE_TOKEN", None)
        self.process = subprocess.Popen(self.command(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        env=env, cwd=ROOT)
        lines: list[str] = []
        found = threading.Event()

        def read():
            for line in self.process.stdout:
                lines.append(line)
                if line.startswith("serving tiny on "):
                    self.url = line.split(" on ")[1].split()[0]
                    found.set()

        threading.Thread(target=read, daemon=True).start()
        if not found.wait(240):
            self.process.kill()
            pytest.fail("the server did not come up:\n" + "".join(lines))
        return self.url

    def close(self):
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(60)


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    server = Live(write_served_model(tmp_path_factory.mktemp("serve") / "hf"))
    yield server
    server.close()


@pytest.fixture
def client(live):
    import openai

    return openai.OpenAI(base_url=live.get() + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def rescore(live):
    """The learner's log-probs (learn/scoring.py, float32) of prompt + completion ids."""
    import jax.numpy as jnp

    from jaxreplay.learn.scoring import sequence_scores
    from jaxreplay.models.hf import load_hf_model
    from jaxreplay.models.transformer import score_hidden

    _, graphdef, params = load_hf_model(live.model)

    def score(prompt, completion, **draw):
        tokens = jnp.asarray([list(prompt) + list(completion)])
        h, unembed = score_hidden(graphdef, params, tokens, jnp.ones_like(tokens, bool))
        lp, _ = sequence_scores(h, tokens, unembed, with_entropy=False, live_vocab=101, **draw)
        return np.asarray(lp)[0, len(prompt):]

    return score


def test_models_lists_the_served_id_and_its_context(client):
    (model,) = client.models.list().data
    assert model.id == "tiny" and model.model_extra["max_model_len"] == PROMPT_LEN + MAX_TOKENS


def test_completion_ids_are_the_engines_and_their_logprobs_the_learners_after_temperature_top_k_top_p(client,
                                                                                                    rescore):
    draw = {"temperature": 0.8, "top_k": 40, "top_p": 0.9}
    ask = lambda: client.completions.create(model="tiny", prompt="12+30 ", max_tokens=24, seed=7, n=3, logprobs=1,
                                            temperature=draw["temperature"], top_p=draw["top_p"],
                                            extra_body={"top_k": draw["top_k"], "return_token_ids": True})
    first, again = ask(), ask()
    assert [c.model_extra["token_ids"] for c in first.choices] == [c.model_extra["token_ids"] for c in again.choices]
    assert len({tuple(c.model_extra["token_ids"]) for c in first.choices}) > 1, "each choice draws with its own key"
    for c in first.choices:
        ids, prompt = c.model_extra["token_ids"], c.model_extra["prompt_token_ids"]
        assert len(ids) == len(c.logprobs.token_logprobs) > 0 and c.finish_reason in ("stop", "length")
        np.testing.assert_allclose(c.logprobs.token_logprobs, rescore(prompt, ids, **draw), atol=1e-5)
        assert c.text == "".join(c.logprobs.tokens).split("<|im_end|>")[0]
    assert first.usage.completion_tokens == sum(len(c.model_extra["token_ids"]) for c in first.choices)


def test_a_token_id_prompt_and_vllms_generate_route_draw_the_same_ids_as_text(live, client):
    import httpx

    text = client.completions.create(model="tiny", prompt="7*6 ", max_tokens=12, seed=11, temperature=1.0,
                                     extra_body={"return_token_ids": True}).choices[0]
    prompt = text.model_extra["prompt_token_ids"]
    by_ids = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, seed=11, temperature=1.0,
                                       extra_body={"return_token_ids": True}).choices[0]
    body = httpx.post(live.get() + "/inference/v1/generate", timeout=60, json={
        "model": "tiny", "token_ids": prompt,
        "sampling_params": {"max_tokens": 12, "seed": 11, "temperature": 1.0, "logprobs": 0}}).json()
    (choice,) = body["choices"]
    assert text.model_extra["token_ids"] == by_ids.model_extra["token_ids"] == choice["token_ids"]
    assert body["prompt_token_ids"] == prompt
    assert [e["token"] for e in choice["logprobs"]["content"]] == [f"token_id:{t}" for t in choice["token_ids"]]


def test_streamed_completions_and_chat_join_to_the_unstreamed_text(client):
    ask = dict(model="tiny", prompt="3+4 ", max_tokens=30, seed=5, temperature=1.0)
    whole = client.completions.create(**ask).choices[0]
    parts = list(client.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
    assert "".join(p.choices[0].text for p in parts if p.choices) == whole.text
    assert [p.choices[0].finish_reason for p in parts if p.choices][-1] == whole.finish_reason
    assert parts[-1].usage.completion_tokens > 0
    chat = dict(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=30, seed=5)
    whole = client.chat.completions.create(**chat).choices[0].message.content
    streamed = "".join(p.choices[0].delta.content or "" for p in client.chat.completions.create(**chat, stream=True))
    assert streamed == whole


def test_a_tool_call_in_the_models_format_comes_back_as_openai_tool_calls(client):
    messages = [{"role": "user", "content": "f of 1?"}]
    reply = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, temperature=0,
                                           max_tokens=16).choices[0]
    assert reply.finish_reason == "tool_calls", reply
    (call,) = reply.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("f", {"x": 1})
    plain = client.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=16).choices[0]
    assert plain.message.content == CALL and not plain.message.tool_calls  # without tools: text
    parts = list(client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, temperature=0,
                                                max_tokens=16, stream=True))
    (streamed,) = [d for p in parts for d in (p.choices[0].delta.tool_calls or [])]
    assert streamed.function.name == "f" and parts[-1].choices[0].finish_reason == "tool_calls"


def test_a_stop_string_ends_the_text_before_it(client):
    whole = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "?"}], temperature=0,
                                           max_tokens=16, stop=["(x"]).choices[0]
    assert (whole.message.content, whole.finish_reason) == ("[f", "stop")


@pytest.mark.parametrize("body, status", [
    (b"{not json", 400),
    (b"[1, 2]", 400),
    (json.dumps({"prompt": "1+1=", "max_tokens": MAX_TOKENS + 1}).encode(), 400),
    (json.dumps({"prompt": "1+1=", "n": 17}).encode(), 400),
    (json.dumps({"prompt": "9" * (PROMPT_LEN + 1)}).encode(), 400),
    (json.dumps({"prompt": [1, 2, 999]}).encode(), 400),
    (json.dumps({"prompt": "1", "temperature": "hot"}).encode(), 400),
    (json.dumps({"prompt": "1", "echo": True}).encode(), 400),
    (json.dumps({"prompt": "1", "model": "other"}).encode(), 404),
    (b'{"prompt": "' + b"1" * (5 << 20) + b'"}', 413),
])
def test_a_bad_request_gets_a_4xx_json_error_and_the_server_goes_on(live, body, status):
    import httpx

    url = live.get()
    response = httpx.post(url + "/v1/completions", content=body, headers={"Content-Type": "application/json"},
                          timeout=60)
    assert response.status_code == status
    assert response.json()["error"]["message"]
    assert httpx.get(url + "/health", timeout=10).json()["status"] == "ok"


def test_a_client_that_disconnects_frees_its_slots_and_a_stuck_one_stalls_no_other(live, client):
    import httpx

    url = live.get()
    before = httpx.get(url + "/health", timeout=10).json()["cancelled_rows"]
    stuck = socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])))  # asks, then never reads
    body = json.dumps({"model": "tiny", "prompt": "y", "n": 4, "max_tokens": MAX_TOKENS, "stream": True,
                       "temperature": 1.0}).encode()
    stuck.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    with httpx.stream("POST", url + "/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": "z", "n": 8, "max_tokens": MAX_TOKENS, "stream": True,
            "temperature": 50.0}) as r:  # near uniform: a row draws EOS once in ~100 tokens, so it outlives the client
        next(r.iter_lines())  # the first event, then the client leaves
    t0 = time.monotonic()
    other = client.completions.create(model="tiny", prompt="5", max_tokens=8, temperature=1.0)
    assert other.choices[0].finish_reason in ("stop", "length") and time.monotonic() - t0 < 30
    stuck.close()
    deadline = time.monotonic() + 30
    while (health := httpx.get(url + "/health", timeout=10).json())["in_flight"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert health["in_flight"] == 0 and health["cancelled_rows"] > before


def test_sigterm_refuses_new_requests_ends_those_in_flight_and_exits_0(live):
    import httpx

    url = live.get()
    results = {}

    def in_flight():
        results["body"] = httpx.post(url + "/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": "8", "n": 8, "max_tokens": MAX_TOKENS, "temperature": 1.0}).json()

    t = threading.Thread(target=in_flight)
    t.start()
    time.sleep(0.3)
    live.process.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    try:  # 503 while requests in flight finish, or no listener once they have
        refused = httpx.post(url + "/v1/completions", json={"prompt": "1"}, timeout=10).status_code
    except httpx.ConnectError:
        refused = "closed"
    t.join(60)
    assert live.process.wait(60) == 0
    assert refused in (503, "closed")
    assert {c["finish_reason"] for c in results["body"]["choices"]} <= {"stop", "length", "abort"}


def test_another_address_than_loopback_needs_a_bearer_token_and_routes_check_it(monkeypatch):
    import asyncio

    from aiohttp.test_utils import TestClient, TestServer

    from jaxreplay.cli import main
    from jaxreplay.serve.app import Server, ServerSettings
    from jaxreplay.serve.protocol import Limits

    monkeypatch.delenv("JAXREPLAY_SERVE_TOKEN", raising=False)
    assert main(["serve", str(ROOT / "configs" / "demo.yaml"), "--hf", "/nonexistent", "--host", "0.0.0.0"]) == 2

    async def ask():
        server = Server(None, None, Limits(8, 8, 1, 32), ServerSettings(model_id="m", call_format="qwen", token="s3"))
        async with TestClient(TestServer(server.app())) as http:
            bare = await http.get("/v1/models")
            wrong = await http.get("/v1/models", headers={"Authorization": "Bearer nope"})
            right = await http.get("/v1/models", headers={"Authorization": "Bearer s3"})
            return bare.status, wrong.status, right.status, (await bare.json())["error"]["message"]

    bare, wrong, right, message = asyncio.run(ask())
    assert (bare, wrong, right) == (401, 401, 200) and "bearer token" in message

"""`jaxreplay serve`: the engines for a loaded policy, the engine thread, then the HTTP server.

The engines share one shape: prompts left-padded to `prompt_len`, at most `max_tokens` drawn,
`slots` rows each; max_model_len is their sum. A first generation at the default draw compiles
the engine's programs before the port opens, so /health answering means ready.
"""

from __future__ import annotations

import asyncio
import os
import threading
from typing import Any, Optional

from jaxreplay.rollout.engine import JaxEngine
from jaxreplay.serve.app import LOOPBACK, Server, ServerSettings, serve
from jaxreplay.serve.protocol import Limits
from jaxreplay.serve.worker import Draw, EngineWorker, Generation

TOKEN_ENV = "JAXREPLAY_SERVE_TOKEN"  # the bearer token, read from the environment (never a command line)
WARMUP_TIMEOUT_S = 900.0


class ServeError(ValueError):
    """A serve setting that cannot work (exit 2, one line)."""

    kind = "error"


def make_worker(graphdef, model_cfg, params, tokenizer, *, slots: int, prompt_len: int, max_tokens: int,
                chunk_steps: int = 8, kv_cache_dtype: Optional[str] = None, prefill_chunk_size: int = 0,
                max_engines: int = 4, version: int = 0) -> EngineWorker:
    if prompt_len + max_tokens > model_cfg.max_seq_len:
        raise ServeError(f"prompt length {prompt_len} + max tokens {max_tokens} exceed the model's max_seq_len "
                         f"{model_cfg.max_seq_len}")
    if min(slots, prompt_len, max_tokens, max_engines) < 1:
        raise ServeError("slots, prompt length, max tokens and max engines must be positive")

    def make_engine(draw: Draw) -> JaxEngine:
        return JaxEngine(graphdef, model_cfg, params, slots=slots, group_size=1, prompt_len=prompt_len,
                         max_new_tokens=max_tokens, chunk_steps=chunk_steps, temperature=draw.temperature,
                         top_p=draw.top_p, top_k=draw.top_k, greedy=draw.greedy, stop_ids=tokenizer.eos_ids,
                         pad_id=tokenizer.pad_id, kv_cache_dtype=kv_cache_dtype,
                         prefill_chunk_size=prefill_chunk_size, version=version, live_vocab=tokenizer.vocab_size)

    return EngineWorker(make_engine, prompt_len=prompt_len, pad_id=tokenizer.pad_id, stop_ids=tokenizer.eos_ids,
                        decode=tokenizer.decode, max_engines=max_engines)


def warm_up(worker: EngineWorker, draw: Draw, prompt: list[int]) -> None:
    """One generation at `draw`: its engine's programs compile before a client waits on them."""
    done = threading.Event()
    gen = Generation(prompt=prompt, n=1, draw=draw, max_tokens=2, seed=0,
                     notify=lambda i, c: done.set() if c.finish_reason else None)
    worker.submit(gen)
    if not done.wait(WARMUP_TIMEOUT_S):
        raise ServeError(f"the engine's warm-up generation did not finish in {WARMUP_TIMEOUT_S:g} s")
    if worker.error:
        raise ServeError(f"the engine failed in its warm-up: {worker.error}")


def bearer_token(host: str) -> Optional[str]:
    """The token clients must send (from TOKEN_ENV); refused without one for an address other than loopback."""
    token = os.environ.get(TOKEN_ENV) or None
    if host not in LOOPBACK and token is None:
        raise ServeError(f"binding {host} (not loopback) needs a bearer token: set {TOKEN_ENV} (docs/security.md)")
    return token


def run_server(worker: EngineWorker, tokenizer: Any, limits: Limits, settings: ServerSettings, *, host: str,
               port: int, warm_draw: Draw, say=print) -> int:
    """Serves until SIGTERM/SIGINT; 0 when it shut down cleanly."""
    settings.token = bearer_token(host)
    worker.start()
    warm_up(worker, warm_draw, [int(tokenizer.eos_id)])
    server = Server(worker, tokenizer, limits, settings)
    asyncio.run(serve(server, host, port, ready=lambda url: say(f"serving {settings.model_id} on {url} "
                                                               f"(max_model_len {limits.max_model_len})",
                                                               flush=True)))
    return 0 if worker.error is None else 1

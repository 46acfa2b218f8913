"""The HTTP server (aiohttp): OpenAI routes and vLLM's token-in/token-out route over the engine thread.

Routes: GET /health, GET /v1/models, POST /v1/completions, POST /v1/chat/completions (both
streaming as server-sent events), POST /inference/v1/generate. Handlers run on one asyncio loop
and reach the engine only through `EngineWorker` (a queue in, callbacks that never block out),
every wait with a timeout. A client that disconnects (aiohttp cancels its handler) or stops
reading (a write past `write_timeout_s`) has its rows stopped, freeing their slots at the next
chunk. SIGTERM: new requests get 503, those in flight get `grace_s` to finish (then end with
finish_reason "abort"), and the process exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import signal
from typing import Any, AsyncIterator, Optional

from aiohttp import web

from jaxreplay.serve import protocol
from jaxreplay.serve.protocol import BadRequest, Limits
from jaxreplay.serve.worker import Choice, EngineWorker, Generation

log = logging.getLogger("jaxreplay.serve")

LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclasses.dataclass
class ServerSettings:
    model_id: str
    call_format: str  # the model family's tool-call format (tasks/tools.py CALL_FORMATS)
    token: Optional[str] = None  # bearer token every route but /health needs; None: no check (loopback only)
    max_body_bytes: int = 4 << 20
    max_in_flight: int = 256  # generations submitted and not finished; past it a request gets 503
    request_timeout_s: float = 600.0  # a request still unfinished after it is stopped, and gets a 504
    write_timeout_s: float = 30.0  # a streaming client that takes longer to take a chunk is dropped
    grace_s: float = 30.0  # after SIGTERM, how long requests in flight may run on


class Server:
    def __init__(self, worker: EngineWorker, tokenizer: Any, limits: Limits, settings: ServerSettings):
        self.worker, self.tokenizer, self.limits, self.settings = worker, tokenizer, limits, settings
        self.closing = False
        self.created = protocol.now()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.settings.max_body_bytes,
                              middlewares=[self._errors, self._auth])
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/inference/v1/generate", self.generate)
        return app

    # -- middleware --------------------------------------------------------------

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        try:
            return await handler(request)
        except BadRequest as e:
            return web.json_response(e.body(), status=e.status)
        except web.HTTPException as e:  # 404, 405, 413 (body past client_max_size), ...
            if e.status < 400:
                raise
            return web.json_response({"error": {"message": e.reason if e.text is None else e.text,
                                                "type": "invalid_request_error", "param": None, "code": e.status}},
                                     status=e.status)
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception as e:  # a bug, not the client's: 500, and the server goes on
            log.exception("request failed")
            return web.json_response({"error": {"message": f"{type(e).__name__}: {e}", "type": "server_error",
                                                "param": None, "code": 500}}, status=500)

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        token = self.settings.token
        if token is not None and request.path != "/health":
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
                raise BadRequest("a valid bearer token is required (Authorization: Bearer ...)", status=401)
        return await handler(request)

    # -- routes --------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        if self.worker.error is not None or not self.worker.alive():
            return web.json_response({"status": "failed", "error": self.worker.error}, status=503)
        return web.json_response({"status": "closing" if self.closing else "ok", "in_flight": self.worker.load(),
                                  "tokens_drawn": self.worker.tokens_drawn,
                                  "cancelled_rows": self.worker.cancelled_rows}, status=503 if self.closing else 200)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{
            "id": self.settings.model_id, "object": "model", "created": self.created, "owned_by": "jaxreplay",
            "root": self.settings.model_id, "max_model_len": self.limits.max_model_len}]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        s = protocol.sampling(body, self.limits, chat=False)
        prompts = protocol.completion_prompts(body, self.tokenizer, self.limits)
        stream = self._stream_flag(body)
        gens = [self._generation(p, s) for p in prompts]
        rid, created, model = protocol.new_id("cmpl"), protocol.now(), self.settings.model_id
        return_ids = body.get("return_token_ids") is True
        if not stream:
            await self._finish(request, gens)
            choices = []
            for g in gens:
                for i, c in enumerate(g.replies):
                    text = protocol.visible_text(self.tokenizer, c)
                    choices.append({"index": len(choices), "text": text, "finish_reason": c.finish_reason,
                                    "stop_reason": c.stop_text,
                                    "logprobs": None if s.logprobs is None else
                                    protocol.completion_logprobs(self.tokenizer, c, 0, len(c.tokens), 0),
                                    **({"token_ids": c.tokens, "prompt_token_ids": g.prompt} if return_ids else {})})
            return web.json_response({"id": rid, "object": "text_completion", "created": created, "model": model,
                                      "choices": choices, "usage": self._usage(gens)})

        def chunk(index: int, c: Choice, text: str, start: int, count: int, final: bool) -> dict:
            return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [{
                "index": index, "text": text, "finish_reason": c.finish_reason if final else None,
                "logprobs": None if s.logprobs is None else
                protocol.completion_logprobs(self.tokenizer, c, start, count, 0),
                **({"token_ids": c.tokens[start:start + count]} if return_ids else {})}]}

        return await self._stream(request, body, gens, s, chunk, head=None)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        s = protocol.sampling(body, self.limits, chat=True)
        prompt, tools = protocol.chat_prompt(body, self.tokenizer, self.limits)
        stream = self._stream_flag(body)
        gen = self._generation(prompt, s)
        rid, created, model = protocol.new_id("chatcmpl"), protocol.now(), self.settings.model_id
        return_ids = body.get("return_token_ids") is True

        def message(c: Choice) -> tuple[dict, str]:
            text = protocol.visible_text(self.tokenizer, c)
            content, calls = (protocol.tool_calls_of(text, self.settings.call_format) if tools else (text, []))
            msg = {"role": "assistant", "content": content}
            if calls:
                msg["tool_calls"] = calls
            return msg, ("tool_calls" if calls and c.finish_reason == "stop" else c.finish_reason)

        if not stream:
            await self._finish(request, [gen])
            choices = []
            for i, c in enumerate(gen.replies):
                msg, reason = message(c)
                choices.append({"index": i, "message": msg, "finish_reason": reason, "stop_reason": c.stop_text,
                                "logprobs": None if s.logprobs is None else
                                protocol.chat_logprobs(self.tokenizer, c, 0, len(c.tokens), s.logprobs),
                                **({"token_ids": c.tokens} if return_ids else {})})
            return web.json_response({"id": rid, "object": "chat.completion", "created": created, "model": model,
                                      "choices": choices, "usage": self._usage([gen]),
                                      **({"prompt_token_ids": prompt} if return_ids else {})})

        def chunk(index: int, c: Choice, text: str, start: int, count: int, final: bool) -> dict:
            delta: dict[str, Any] = {}
            reason = c.finish_reason if final else None
            if tools and final:  # a tool call is known once the turn is whole: sent as one delta
                msg, reason = message(c)
                if msg.get("tool_calls"):
                    delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(msg["tool_calls"])]
                    if msg["content"]:
                        delta["content"] = msg["content"]
                else:
                    delta["content"] = msg["content"] or ""
            elif text:
                delta["content"] = text
            return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [{
                "index": index, "delta": delta, "finish_reason": reason,
                "logprobs": None if s.logprobs is None else
                protocol.chat_logprobs(self.tokenizer, c, start, count, s.logprobs),
                **({"token_ids": c.tokens[start:start + count]} if return_ids else {})}]}

        head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None,
                             "logprobs": None} for i in range(s.n)]}
        return await self._stream(request, body, [gen], s, chunk, head=head, hold_text=bool(tools))

    async def generate(self, request: web.Request) -> web.Response:
        """vLLM's /inference/v1/generate: token ids in, token ids and log-probs out."""
        body = await self._body(request)
        if body.get("stream"):
            raise BadRequest("stream is not supported on /inference/v1/generate (docs/serving.md)", "stream")
        params = body.get("sampling_params") or {}
        if not isinstance(params, dict):
            raise BadRequest("sampling_params must be an object", "sampling_params")
        s = protocol.sampling(params, self.limits, chat=False, where="sampling_params.")
        prompt = protocol.check_ids(body.get("token_ids"), self.limits, "token_ids")
        gen = self._generation(prompt, s)
        await self._finish(request, [gen])
        return web.json_response({
            "request_id": body.get("request_id") or protocol.new_id("gen"),
            "choices": [{"index": i, "token_ids": c.tokens, "finish_reason": c.finish_reason,
                         "logprobs": None if s.logprobs is None else
                         protocol.chat_logprobs(self.tokenizer, c, 0, len(c.tokens), s.logprobs, as_ids=True)}
                        for i, c in enumerate(gen.replies)],
            "prompt_token_ids": prompt, "prompt_logprobs": None, "kv_transfer_params": None,
            "usage": self._usage([gen])})

    # -- the work ------------------------------------------------------------------

    async def _body(self, request: web.Request) -> dict:
        if self.closing:
            raise BadRequest("the server is shutting down", status=503)
        if self.worker.error is not None:
            raise BadRequest(f"the engine failed: {self.worker.error}", status=503)
        raw = await request.read()  # past client_max_size: aiohttp raises 413
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BadRequest(f"the body is not JSON: {e}") from None
        if not isinstance(body, dict):
            raise BadRequest("the body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.settings.model_id:
            raise BadRequest(f"model {model!r} is not served here (this server serves {self.settings.model_id!r})",
                             "model", status=404)
        return body

    @staticmethod
    def _stream_flag(body: dict) -> bool:
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise BadRequest("stream must be a boolean", "stream")
        return stream

    def _generation(self, prompt: list[int], s: protocol.Sampling) -> Generation:
        if self.worker.load() + s.n > self.settings.max_in_flight:
            raise BadRequest(f"the server has {self.settings.max_in_flight} generations in flight; retry later",
                             status=503)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def notify(index: int, choice: Choice) -> None:  # on the engine thread: never blocks
            snapshot = dataclasses.replace(choice)
            try:
                loop.call_soon_threadsafe(events.put_nowait, (index, snapshot))
            except RuntimeError:  # the loop has closed: nobody is listening
                pass

        gen = Generation(prompt=prompt, n=s.n, draw=s.draw, max_tokens=s.max_tokens, notify=notify, stop=s.stop,
                         stop_token_ids=s.stop_token_ids, seed=s.seed)
        gen.events = events
        gen.replies = [Choice() for _ in range(s.n)]  # this loop's copies: the engine thread owns gen.choices
        return gen

    async def _events(self, request: web.Request, gens: list[Generation]) -> AsyncIterator[tuple[int, int, Choice]]:
        """(generation, choice, its state) as the engine thread reports them, until every choice
        has finished. Leaving early (the client went, a timeout) stops the rest in the engine."""
        for g in gens:
            self.worker.submit(g)
        left = {(k, i) for k, g in enumerate(gens) for i in range(g.n)}
        deadline = asyncio.get_running_loop().time() + self.settings.request_timeout_s
        merged: asyncio.Queue = asyncio.Queue()
        pumps = [asyncio.ensure_future(_pump(k, g.events, merged)) for k, g in enumerate(gens)]
        try:
            while left:
                remaining = deadline - asyncio.get_running_loop().time()
                try:
                    k, i, choice = await asyncio.wait_for(merged.get(), timeout=max(remaining, 0.001))
                except asyncio.TimeoutError:
                    raise BadRequest(f"the request did not finish in {self.settings.request_timeout_s:g} s",
                                     status=504) from None
                if choice.finish_reason is not None:
                    left.discard((k, i))
                yield k, i, choice
        finally:
            for p in pumps:
                p.cancel()
            if left:
                for k in {k for k, _ in left}:
                    self.worker.cancel(gens[k])

    async def _finish(self, request: web.Request, gens: list[Generation]) -> None:
        async with contextlib.aclosing(self._events(request, gens)) as events:  # left early: rows stopped now
            async for k, i, choice in events:
                gens[k].replies[i] = choice

    def _usage(self, gens: list[Generation]) -> dict:
        total = [protocol.usage(len(g.prompt), g.replies) for g in gens]
        return {key: sum(u[key] for u in total) for key in ("prompt_tokens", "completion_tokens", "total_tokens")}

    async def _stream(self, request: web.Request, body: dict, gens: list[Generation], s: protocol.Sampling, chunk,
                      head: Optional[dict], hold_text: bool = False) -> web.StreamResponse:
        """Server-sent events: a chunk per choice per engine step that added text, a last chunk
        per choice with its finish_reason, usage if stream_options.include_usage, then [DONE].
        Text that could still become a stop string is held back until it cannot."""
        options = body.get("stream_options") or {}
        include_usage = isinstance(options, dict) and options.get("include_usage") is True
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)

        async def send(payload) -> None:
            data = payload if isinstance(payload, str) else json.dumps(payload)
            await asyncio.wait_for(response.write(f"data: {data}\n\n".encode()), self.settings.write_timeout_s)

        if head is not None:
            await send(head)
        sent_text: dict[tuple[int, int], str] = {}
        sent_tokens: dict[tuple[int, int], int] = {}
        hold = max((len(x) for x in s.stop), default=1) - 1
        index_of = {}
        for k, g in enumerate(gens):
            for i in range(g.n):
                index_of[(k, i)] = len(index_of)
        try:
            async with contextlib.aclosing(self._events(request, gens)) as events:
                async for k, i, c in events:
                    gens[k].replies[i] = c
                    final = c.finish_reason is not None
                    if final:
                        text = protocol.visible_text(self.tokenizer, c)
                    elif hold_text:
                        continue
                    else:
                        text = self.tokenizer.decode(c.tokens)
                        text = text[:len(text) - hold] if hold else text
                        text = text.rstrip("\ufffd")  # a character whose bytes are not all drawn yet
                    done = sent_text.get((k, i), "")
                    delta = text[len(done):] if text.startswith(done) else ""
                    start = sent_tokens.get((k, i), 0)
                    if delta or final or len(c.tokens) > start:
                        await send(chunk(index_of[(k, i)], c, delta, start, len(c.tokens) - start, final))
                        sent_text[(k, i)] = done + delta
                        sent_tokens[(k, i)] = len(c.tokens)
            if include_usage:
                await send({"id": head["id"] if head else protocol.new_id("cmpl"), "object": "usage", "choices": [],
                            "usage": self._usage(gens), "model": self.settings.model_id})
        except (asyncio.TimeoutError, ConnectionResetError):  # a client that left or stopped reading:
            return response  # its rows were stopped as _events ended
        await send("[DONE]")
        await response.write_eof()
        return response


async def _pump(k: int, source: asyncio.Queue, merged: asyncio.Queue) -> None:
    while True:
        i, choice = await source.get()
        merged.put_nowait((k, i, choice))


async def serve(server: Server, host: str, port: int, *, ready=lambda url: None) -> None:
    """Runs until SIGTERM or SIGINT, then shuts down as the module says."""
    runner = web.AppRunner(server.app(), handler_cancellation=True, access_log=None,
                           shutdown_timeout=server.settings.grace_s + 5)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0]
    ready(f"http://{'[' + bound[0] + ']' if ':' in bound[0] else bound[0]}:{bound[1]}")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    server.closing = True
    grace = server.settings.grace_s
    stopped = await loop.run_in_executor(None, server.worker.close, grace, grace + 10)
    if not stopped:
        log.warning("the engine thread did not stop within %.0f s", grace + 10)
    await runner.cleanup()

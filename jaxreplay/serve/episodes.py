"""The endpoint a training run serves its agent-loop episodes on (`environment.name: agent_loop`).

The same server as `jaxreplay serve` (app.py: routes, request fields, response shapes, bearer
token, bounds), answered by the run's own rollout engine through `OutsideEpisodes` instead of an
`EngineWorker`: every call names its episode (`X-Episode-Id`, or an `episode_id` body field), and
its turn is drawn with the run's sampling settings and keys. A call that asks for other ones
(temperature, top_p, top_k, seed, stop, n > 1, max_tokens below `sampling.max_new_tokens`) or to
stream is refused with a 400 rather than served differently from what the learner trains on.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any, AsyncIterator, Optional

from aiohttp import web

from jaxreplay.rollout.outside import OutsideEpisodes, Refused, Turn
from jaxreplay.serve import protocol
from jaxreplay.serve.app import Server, ServerSettings
from jaxreplay.serve.protocol import BadRequest, Limits
from jaxreplay.serve.worker import Choice, Draw, Generation
from jaxreplay.tasks.agent_loop import EPISODE_FIELD, EPISODE_HEADER

# How each refusal answers: a call for no open episode is a 404; one the episode cannot take now, a 409.
STATUS = {"unknown": 404, "gone": 409, "busy": 409, "over": 409, "rerendered_prompt": 409, "too_long": 413}
START_TIMEOUT_S = 30.0


class _Desk:
    """What `Server` asks of its engine worker, answered for the episodes: they have no engine
    thread of their own (the run's actor steps the engine)."""

    error: Optional[str] = None
    cancelled_rows = 0

    def __init__(self, episodes: OutsideEpisodes):
        self.episodes = episodes

    def alive(self) -> bool:
        return True

    def load(self) -> int:
        return self.episodes.in_flight()

    @property
    def tokens_drawn(self) -> int:
        return self.episodes.calls


class EpisodeServer(Server):
    def __init__(self, episodes: OutsideEpisodes, tokenizer: Any, limits: Limits, settings: ServerSettings,
                 draw: Draw, max_new_tokens: int):
        super().__init__(_Desk(episodes), tokenizer, limits, settings)
        self.episodes, self.draw, self.max_new_tokens = episodes, draw, max_new_tokens

    def _generation(self, prompt: list[int], s: protocol.Sampling, request: web.Request) -> Generation:
        body = request["body"]
        header, field = request.headers.get(EPISODE_HEADER), body.get(EPISODE_FIELD)
        if field is not None and not isinstance(field, str):
            raise BadRequest(f"{EPISODE_FIELD} must be a string", EPISODE_FIELD)
        if header and field and header != field:
            raise BadRequest(f"the {EPISODE_HEADER} header and the {EPISODE_FIELD} field name different episodes",
                             EPISODE_FIELD)
        episode = header or field
        if not episode:
            raise BadRequest(f"this endpoint serves a training run's episodes: name yours with the {EPISODE_HEADER} "
                             f"header or an {EPISODE_FIELD} field (docs/serving.md)", EPISODE_FIELD)
        self._check_sampling(body.get("sampling_params") if request.path.startswith("/inference") else body, s)
        gen = super()._generation(prompt, s, request)
        gen.episode = episode
        return gen

    def _check_sampling(self, fields: Optional[dict], s: protocol.Sampling) -> None:
        """An episode's tokens are drawn as the run draws: a call may repeat the run's settings, never change them."""
        fields = fields or {}
        if fields.get("stream"):
            raise BadRequest("episode calls do not stream (docs/serving.md)", "stream")
        if s.n != 1:
            raise BadRequest("an episode call draws one choice (n 1): an episode is one row", "n")
        run = {"temperature": self.draw.temperature, "top_p": self.draw.top_p, "top_k": self.draw.top_k}
        for name, value in run.items():
            given = fields.get(name)
            if given is not None and not (name == "top_k" and given in (-1, 0) and value == 0) and given != value:
                raise BadRequest(f"{name} {given} differs from the run's ({value}): an episode's tokens are drawn with "
                                 f"the run's sampling settings", name)
        for name in ("seed", "stop", "stop_token_ids"):
            if fields.get(name):
                raise BadRequest(f"{name} is not taken in an episode call: the run's keys and turn-end ids decide",
                                 name)
        if s.max_tokens < self.max_new_tokens:
            raise BadRequest(f"max_tokens {s.max_tokens} is below the run's sampling.max_new_tokens "
                             f"({self.max_new_tokens}): an episode's turn runs to its turn-end id or the episode's "
                             f"token budget; leave max_tokens out", "max_tokens")

    async def _events(self, request: web.Request, gens: list[Generation]) -> AsyncIterator[tuple[int, int, Choice]]:
        if len(gens) != 1:
            raise BadRequest("an episode call takes one prompt", "prompt")
        gen = gens[0]
        loop = asyncio.get_running_loop()
        future: concurrent.futures.Future = concurrent.futures.Future()

        def reply(result) -> None:  # any thread; the client may have left (the future cancelled)
            try:
                future.set_result(result)
            except concurrent.futures.InvalidStateError:
                pass

        self.episodes.call(gen.episode, list(gen.prompt), reply)
        try:
            result = await asyncio.wait_for(asyncio.wrap_future(future, loop=loop), self.settings.request_timeout_s)
        except asyncio.TimeoutError:
            raise BadRequest(f"the episode's turn did not come in {self.settings.request_timeout_s:g} s",
                             status=504) from None
        if isinstance(result, Refused):
            raise BadRequest(str(result), "prompt", status=STATUS.get(result.kind, 409))
        assert isinstance(result, Turn)
        yield 0, 0, Choice(tokens=result.tokens, logprobs=result.logprobs, finish_reason=result.finish_reason)


class EpisodeEndpoint:
    """The server on a thread of its own, with its own event loop: up once `start` returns."""

    def __init__(self, server: EpisodeServer, host: str, port: int):
        self.server, self.host, self.port = server, host, port
        self.url: Optional[str] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._stop: Optional[asyncio.Event] = None
        self._ready = threading.Event()
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name="jaxreplay-episodes", daemon=True)

    def start(self) -> str:
        self._thread.start()
        if not self._ready.wait(START_TIMEOUT_S) or self._error is not None:
            raise RuntimeError(f"the episode endpoint did not start on {self.host}:{self.port}: {self._error}")
        return self.url

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(10)

    def _run(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as e:  # noqa: BLE001 - reported to `start`
            self._error = e
            self._ready.set()

    async def _serve(self) -> None:
        runner = web.AppRunner(self.server.app(), handler_cancellation=True, access_log=None, shutdown_timeout=5)
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.port)
        await site.start()
        host, port = runner.addresses[0][:2]
        self.url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        self._ready.set()
        await self._stop.wait()
        await runner.cleanup()


def serve_episodes(episodes: OutsideEpisodes, tokenizer: Any, *, prompt_len: int, max_new_tokens: int, draw: Draw,
                   host: str, port: int, model_id: str, call_format: str, token: Optional[str]) -> EpisodeEndpoint:
    """Starts the endpoint and points the episodes' harnesses at it (`base_url` ends in /v1)."""
    limits = Limits(prompt_len=prompt_len + max_new_tokens, max_tokens=max_new_tokens, max_n=1,
                    vocab_size=tokenizer.vocab_size)
    settings = ServerSettings(model_id=model_id, call_format=call_format, token=token)
    endpoint = EpisodeEndpoint(EpisodeServer(episodes, tokenizer, limits, settings, draw, max_new_tokens), host, port)
    url = endpoint.start()
    episodes.base_url, episodes.token, episodes.model_id = f"{url}/v1", token, model_id
    episodes.on_close = endpoint.stop
    return endpoint

"""The OpenAI-compatible endpoint of a generator whose episodes are agents (actors/agents.py).

`Endpoint` serves `/v1/chat/completions` and `/v1/completions` under one base URL per episode,
`http://HOST:PORT/episodes/<episode>/v1`, on the agents' asyncio loop. It turns each request into
prompt token ids and hands them to its `Sampler` (the AgentEngine), which runs them through the
generator's own engine, continuously batched with every other request, and returns what was
sampled: a `Call`. Every request must carry the endpoint's key (`Authorization: Bearer <key>`,
the `api_key` the agent's client is given); any other is refused with 401.

Exact tokens. An agent sends its history back as text. Where an assistant message's content
equals the text of a call this episode sampled (in order), its tokens in the new prompt are
that call's sampled ids, not a re-tokenization of the text: the chat template is rendered with a
marker in place of each such content, the text between markers is tokenized, and the sampled ids
go in at the markers (the end-of-turn token the template writes after a content is left out
where the sampled ids already end with it). So an ordinary agent's calls extend one another
token for token. An assistant message that matches no sampled call (one the agent wrote or
edited) is tokenized as text: the prompt no longer extends the earlier calls, which is what
actors/agents.py counts as a rewritten history. `/v1/completions` does the same for a prompt
string that starts with an earlier call's prompt and answer (or takes token ids as they are).

Wire format: messages (string or text-part contents), max_tokens / max_completion_tokens,
temperature (only the generator's: the learner's importance weights assume it), stop, n (1: an
episode is one chain of calls), tools and tool_choice ("none" leaves the tools out) rendered by
the chat template. With env.tool_parser naming one of vLLM's tool parsers, the reply's
`tool_calls` are parsed from the text; without one the reply is plain text. No streaming.
"""

from __future__ import annotations

import hmac
import itertools
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from async_rlhf.types import Sample

_MARK = "\x00sampled-{}\x00"
_MARKS = re.compile("\x00sampled-\\d+\x00")


class EndpointError(Exception):
    """A request the endpoint refuses: its HTTP status and OpenAI error message."""

    def __init__(self, status: int, message: str, code: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


@dataclass(frozen=True)
class CallRequest:
    prompt_ids: tuple[int, ...]
    prompt_text: str  # what the ids render (for /v1/completions' history)
    max_tokens: int | None
    stop: tuple[str, ...] = ()


@dataclass(frozen=True)
class Call:
    """One call as the engine ran it: the prompt ids it received and what it sampled."""

    request: CallRequest
    sample: Sample  # response ids, behaviour log-probs, version spans, text

    @property
    def prompt_ids(self) -> tuple[int, ...]:
        return self.request.prompt_ids


class Sampler(Protocol):
    def calls(self, episode: str) -> Sequence[Call]:
        """The episode's calls so far (EndpointError 404 for an episode that is not open)."""

    async def sample(self, episode: str, request: CallRequest) -> Call: ...


def _text(content) -> str | None:
    """A message's content as text: a string, or the text of OpenAI's content parts."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(p.get("text", "") for p in content)
    raise EndpointError(400, f"message content {content!r:.80} is not text: only text (or text parts) is served")


def _tail(tokenizer, sample: Sample) -> str:
    """What the sampled ids say after the text given back (an end-of-turn token, a stop string)."""
    full = tokenizer.decode(sample.response_ids.tolist(), skip_special_tokens=False)
    return full[len(sample.text):] if full.startswith(sample.text) else ""


def _splice(tokenizer, pieces: Sequence[str], calls: Sequence[Call]) -> list[int]:
    """pieces[0], calls[0]'s sampled ids, pieces[1], ...: the text tokenized, the ids as sampled."""
    ids = tokenizer.encode(pieces[0], add_special_tokens=False)
    for call, piece in zip(calls, pieces[1:]):
        ids += call.sample.response_ids.tolist()
        tail = _tail(tokenizer, call.sample)
        ids += tokenizer.encode(piece[len(tail):] if tail and piece.startswith(tail) else piece,
                                add_special_tokens=False)
    return ids


def chat_prompt(tokenizer, messages: list, tools: list | None, calls: Sequence[Call]) -> tuple[list[int], str]:
    """The prompt ids and text of a chat request, the sampled ids standing for the assistant
    messages that equal earlier calls' texts (see the module doc)."""
    rendered, spliced, after = [], [], 0
    for m in messages:
        if not isinstance(m, dict) or "role" not in m:
            raise EndpointError(400, f"message {m!r:.80} has no role")
        m = {**m, "content": _text(m.get("content"))}
        if m["role"] == "assistant" and m["content"] is not None:
            match = next((j for j in range(after, len(calls)) if calls[j].sample.text == m["content"]), None)
            if match is not None:
                after = match + 1
                m["content"] = _MARK.format(len(spliced))
                spliced.append(calls[match])
        rendered.append(m)
    try:
        text = tokenizer.apply_chat_template(rendered, tools=tools or None, add_generation_prompt=True,
                                             tokenize=False)
    except Exception as e:  # noqa: BLE001 - a template error is the request's
        raise EndpointError(400, f"the chat template could not render the messages: {type(e).__name__}: {e}") from e
    pieces = _MARKS.split(text)
    if len(pieces) != len(spliced) + 1:  # the template dropped or repeated a content: text only
        return chat_prompt(tokenizer, messages, tools, ())
    return _splice(tokenizer, pieces, spliced), _MARKS.sub(lambda _: "", text)


def completion_prompt(tokenizer, prompt, calls: Sequence[Call]) -> tuple[list[int], str]:
    """The prompt ids of a /v1/completions request: token ids as given; a string that starts
    with an earlier call's prompt and answer extends that call's ids; any other is tokenized."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return list(prompt), tokenizer.decode(prompt)
    if not isinstance(prompt, str) or not prompt:
        raise EndpointError(400, f"prompt {prompt!r:.80} must be one non-empty string or a list of token ids")
    for call in reversed(calls):
        head = call.request.prompt_text + call.sample.text
        if prompt.startswith(head):
            return list(call.prompt_ids) + _splice(tokenizer, ["", prompt[len(head):]], [call]), prompt
    return tokenizer.encode(prompt), prompt


class Endpoint:
    """The aiohttp server: start() on the agents' loop, base_url(episode) for each episode's
    client, close() at the end."""

    def __init__(self, sampler: Sampler, tokenizer, *, key: str, temperature: float, host: str,
                 model: str = "policy", tool_parser: str = ""):
        self.sampler, self.tokenizer, self.key = sampler, tokenizer, key
        self.temperature, self.host, self.model = temperature, host, model
        self._parser = _tool_parser(tool_parser, tokenizer) if tool_parser else None
        self._ids = itertools.count()
        self._runner = None
        self.port = 0

    def base_url(self, episode: str) -> str:
        return f"http://{self.host}:{self.port}/episodes/{episode}/v1"

    async def start(self) -> None:
        from aiohttp import web

        app = web.Application(middlewares=[self._guard], client_max_size=64 << 20)
        app.router.add_post("/episodes/{episode}/v1/chat/completions", self._chat)
        app.router.add_post("/episodes/{episode}/v1/completions", self._completions)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, 0)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def _error(self, status: int, message: str, code: str):
        from aiohttp import web

        return web.json_response({"error": {"message": message, "type": "invalid_request_error", "code": code}},
                                 status=status)

    async def _guard(self, app, handler):
        async def guarded(request):
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.key}".encode()):
                return self._error(401, "missing or wrong API key: use the api_key this job gave the "
                                   "agent's client (Authorization: Bearer <key>)", "invalid_api_key")
            try:
                return await handler(request)
            except EndpointError as e:
                return self._error(e.status, e.message, e.code)
        return guarded

    async def _parse(self, request) -> tuple[str, dict]:
        try:
            body = await request.json()
        except ValueError as e:
            raise EndpointError(400, f"the request body is not JSON: {e}") from None
        if not isinstance(body, dict):
            raise EndpointError(400, "the request body must be a JSON object")
        if body.get("n", 1) != 1:
            raise EndpointError(400, f"n={body['n']}: an episode is one chain of calls, so n must be 1 "
                                "(generator.group_size sets how many episodes a prompt gets)")
        if body.get("stream"):
            raise EndpointError(400, "stream=true is not served: ask for the whole reply")
        temperature = body.get("temperature")
        if temperature is not None and abs(temperature - self.temperature) > 1e-9:
            raise EndpointError(400, f"temperature={temperature}: the learner's importance weights assume "
                                f"generator.temperature={self.temperature}; leave it out or send that value")
        return request.match_info["episode"], body

    def _request(self, body: dict, prompt_ids: list[int], text: str) -> CallRequest:
        stop = body.get("stop") or ()
        stop = (stop,) if isinstance(stop, str) else tuple(stop)
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
            raise EndpointError(400, f"max_tokens={max_tokens!r} must be a positive integer")
        return CallRequest(tuple(prompt_ids), text, max_tokens, stop)

    def _reply(self, kind: str, body: dict, call: Call, choice: dict):
        from aiohttp import web

        prompt, completion = len(call.prompt_ids), len(call.sample.response_ids)
        return web.json_response({
            "id": f"{kind}-{next(self._ids)}", "object": kind, "created": int(time.time()),
            "model": body.get("model") or self.model,
            "choices": [{"index": 0, "finish_reason": "stop" if call.sample.finished else "length",
                         "logprobs": None, **choice}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion},
        })

    async def _chat(self, request):
        episode, body = await self._parse(request)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise EndpointError(400, "messages must be a non-empty list")
        tools = None if body.get("tool_choice") == "none" else body.get("tools")
        ids, text = chat_prompt(self.tokenizer, messages, tools, self.sampler.calls(episode))
        call = await self.sampler.sample(episode, self._request(body, ids, text))
        message = {"role": "assistant", "content": call.sample.text}
        if self._parser is not None and tools:
            message = self._parse_tools(body, call.sample.text)
        return self._reply("chat.completion", body, call,
                           {"message": message} | ({"finish_reason": "tool_calls"} if message.get("tool_calls") else {}))

    async def _completions(self, request):
        episode, body = await self._parse(request)
        ids, text = completion_prompt(self.tokenizer, body.get("prompt"), self.sampler.calls(episode))
        call = await self.sampler.sample(episode, self._request(body, ids, text))
        return self._reply("text_completion", body, call, {"text": call.sample.text})

    def _parse_tools(self, body: dict, text: str) -> dict:
        """The reply's tool calls, as the model's format writes them (vLLM's parser)."""
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        info = self._parser.extract_tool_calls(text, ChatCompletionRequest(**body))
        if not info.tools_called:
            return {"role": "assistant", "content": text}
        return {"role": "assistant", "content": info.content or None,
                "tool_calls": [c.model_dump() for c in info.tool_calls]}


def _tool_parser(name: str, tokenizer):
    from vllm.tool_parsers import ToolParserManager

    try:
        return ToolParserManager.get_tool_parser(name)(tokenizer)
    except KeyError:
        raise ValueError(f"env.tool_parser={name!r} is not one of vLLM's tool parsers: pick one of "
                         f"{sorted(ToolParserManager.list_registered())[:40]}") from None

"""The OpenAI-compatible HTTP front end: FastAPI routes over one in-process `LLM`.

Media loading and HF preprocessing run in the LLM's thread pool, so the event loop only parses JSON, relays tokens
and writes responses. Every bad input is a 400 with an OpenAI error body; a client that disconnects has its request
aborted, which frees its KV blocks.
"""
import asyncio
from contextlib import aclosing
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel

from ..engine.sequence import Sequence
from ..llmapi.llm import LLM
from ..llmapi.outputs import RequestOutput
from .metrics import RequestTimer, ServerMetrics
from .protocol import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest,
                       ChatCompletionResponse, ChatLogprobs, CompletionChoice, CompletionLogprobs,
                       CompletionRequest, CompletionResponse, Delta, ErrorBody, ErrorResponse, ModelCard, ModelList,
                       TokenLogprob, TopLogprob, Usage, make_id)


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "BadRequestError"):
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


def error_response(status: int, message: str, kind: str) -> JSONResponse:
    body = ErrorResponse(error=ErrorBody(message=message, type=kind, code=status))
    return JSONResponse(body.model_dump(), status_code=status)


def sse(payload: BaseModel) -> str:
    return f"data: {payload.model_dump_json(exclude_none=True)}\n\n"


class Completion:
    """One choice's text, tokens and logprobs, accumulated from streamed outputs."""

    def __init__(self):
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, float]] = []
        self.finish_reason: str | None = None
        self.stop_reason = None

    def add(self, c) -> list[dict[int, float]]:
        """Takes one streamed CompletionOutput; returns the logprob entries of its new tokens."""
        self.text += c.text_diff
        self.token_ids += c.token_ids_diff
        new = c.logprobs[len(c.logprobs) - len(c.token_ids_diff):] if c.logprobs is not None else []
        self.logprobs += new
        self.finish_reason, self.stop_reason = c.finish_reason, c.stop_reason
        return new


class OpenAIServer:
    def __init__(self, llm: LLM, model_name: str, chat_template: str | None = None):
        self.llm = llm
        self.model_name = model_name
        self.chat_template = chat_template
        self.tokenizer = llm.tokenizer
        self.metrics = ServerMetrics(llm.engine)
        self.app = self.build_app()

    def build_app(self) -> FastAPI:
        app = FastAPI(title="trtllm-qwenvl", version="0.1")
        app.add_exception_handler(RequestValidationError, self.on_validation_error)
        app.add_exception_handler(ApiError, self.on_api_error)
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/v1/models", self.models, methods=["GET"])
        app.add_api_route("/metrics", self.metrics_text, methods=["GET"])
        app.add_api_route("/v1/chat/completions", self.chat, methods=["POST"])
        app.add_api_route("/v1/completions", self.completions, methods=["POST"])
        return app

    # ---- errors ---------------------------------------------------------------------------------------------
    @staticmethod
    async def on_validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
        return error_response(400, f"invalid request: {problems}", "BadRequestError")

    @staticmethod
    async def on_api_error(_request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.kind)

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise ApiError(404, f"the model `{name}` does not exist; this server serves `{self.model_name}`",
                           "NotFoundError")

    # ---- simple routes --------------------------------------------------------------------------------------
    async def health(self) -> Response:
        return Response(status_code=200 if self.llm.loop.thread.is_alive() else 503)

    async def models(self) -> ModelList:
        return ModelList(data=[ModelCard(id=self.model_name, max_model_len=self.llm.engine.max_seq_len)])

    async def metrics_text(self) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    # ---- preparing ------------------------------------------------------------------------------------------
    async def prepare(self, work, *args) -> list[Sequence]:
        """Runs `work` (media loading, templating, HF processing) in the pool; bad input becomes a 400."""
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self.llm.pool, work, *args)
        except ValueError as e:
            raise ApiError(400, str(e)) from e

    def prepare_chat(self, body: ChatCompletionRequest, request_id: str) -> list[Sequence]:
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        prompt = self.llm.chat_prompt(messages, body.chat_template or self.chat_template)
        return self.llm.prepare(prompt, body.to_sampling_params(), request_id)

    def prepare_completion(self, body: CompletionRequest, prompt, request_id: str) -> list[Sequence]:
        if body.echo and body.logprobs is not None:
            raise ValueError("echo with logprobs is not supported")
        prompt = {"prompt": prompt} if isinstance(prompt, str) else {"prompt_token_ids": prompt}
        return self.llm.prepare(prompt, body.to_sampling_params(), request_id)

    # ---- chat -----------------------------------------------------------------------------------------------
    async def chat(self, body: ChatCompletionRequest, raw: Request):
        self.check_model(body.model)
        timer = RequestTimer(self.metrics)
        request_id = make_id("chatcmpl")
        seqs = await self.prepare(self.prepare_chat, body, request_id)
        timer.preprocessed()
        if body.stream:
            return StreamingResponse(self.chat_stream(body, request_id, seqs, timer), media_type="text/event-stream")
        choices = await until_disconnected(raw, self.collect([seqs], timer))
        if choices is None:
            return Response(status_code=499)
        return ChatCompletionResponse(
            id=request_id, model=self.model_name, usage=usage([seqs], choices),
            choices=[ChatChoice(index=i, message=AssistantMessage(content=c.text), finish_reason=c.finish_reason,
                                stop_reason=c.stop_reason, logprobs=self.chat_logprobs(c.logprobs, body))
                     for i, c in enumerate(choices)])

    def chat_stream(self, body: ChatCompletionRequest, request_id: str, seqs: list[Sequence],
                    timer: RequestTimer) -> AsyncIterator[str]:
        def chunk(choices: list[ChatChunkChoice], u: Usage | None = None) -> ChatCompletionChunk:
            return ChatCompletionChunk(id=request_id, model=self.model_name, choices=choices, usage=u)

        def delta(c, new_logprobs) -> ChatCompletionChunk:
            return chunk([ChatChunkChoice(index=c.index, delta=Delta(content=c.text_diff),
                                          logprobs=self.chat_logprobs(new_logprobs, body),
                                          finish_reason=c.finish_reason, stop_reason=c.stop_reason)])

        head = [chunk([ChatChunkChoice(index=i, delta=Delta(role="assistant", content=""))]) for i in range(len(seqs))]
        return self.events([seqs], timer, head, delta, (lambda u: chunk([], u)) if body.include_usage else None)

    def chat_logprobs(self, entries: list[dict[int, float]], body: ChatCompletionRequest) -> ChatLogprobs | None:
        if not body.logprobs:
            return None
        content = []
        for entry in entries:
            token_id, logprob = next(iter(entry.items()))  # the sampled token comes first
            top = [TopLogprob(**self.token_info(t, lp)) for t, lp in top_k(entry, body.top_logprobs or 0)]
            content.append(TokenLogprob(**self.token_info(token_id, logprob), top_logprobs=top))
        return ChatLogprobs(content=content)

    def token_info(self, token_id: int, logprob: float) -> dict:
        text = self.tokenizer.decode([token_id])
        return {"token": text, "logprob": max(logprob, -9999.0), "bytes": list(text.encode())}

    # ---- completions ----------------------------------------------------------------------------------------
    async def completions(self, body: CompletionRequest, raw: Request):
        self.check_model(body.model)
        timer = RequestTimer(self.metrics)
        request_id = make_id("cmpl")
        try:
            prompts = body.prompts()
        except ValueError as e:
            raise ApiError(400, str(e)) from e
        groups = await asyncio.gather(*[self.prepare(self.prepare_completion, body, p, f"{request_id}-{i}")
                                        for i, p in enumerate(prompts)])
        timer.preprocessed()
        if body.stream:
            return StreamingResponse(self.completion_stream(body, request_id, groups, timer),
                                     media_type="text/event-stream")
        choices = await until_disconnected(raw, self.collect(groups, timer))
        if choices is None:
            return Response(status_code=499)
        seqs = [s for g in groups for s in g]
        return CompletionResponse(
            id=request_id, model=self.model_name, usage=usage(groups, choices),
            choices=[CompletionChoice(index=i, text=self.echo(body, seqs[i]) + c.text, finish_reason=c.finish_reason,
                                      stop_reason=c.stop_reason,
                                      logprobs=self.completion_logprobs(c.token_ids, c.logprobs, body))
                     for i, c in enumerate(choices)])

    def completion_stream(self, body: CompletionRequest, request_id: str, groups: list[list[Sequence]],
                          timer: RequestTimer) -> AsyncIterator[str]:
        def chunk(choices: list[CompletionChoice], u: Usage | None = None) -> CompletionResponse:
            return CompletionResponse(id=request_id, model=self.model_name, choices=choices, usage=u)

        def delta(c, new_logprobs) -> CompletionResponse:
            return chunk([CompletionChoice(index=c.index, text=c.text_diff, finish_reason=c.finish_reason,
                                           stop_reason=c.stop_reason,
                                           logprobs=self.completion_logprobs(c.token_ids_diff, new_logprobs, body))])

        seqs = [s for g in groups for s in g]
        head = [chunk([CompletionChoice(index=i, text=self.echo(body, s))]) for i, s in enumerate(seqs)] \
            if body.echo else []
        return self.events(groups, timer, head, delta, (lambda u: chunk([], u)) if body.include_usage else None)

    def echo(self, body: CompletionRequest, seq: Sequence) -> str:
        if not body.echo:
            return ""
        return seq.prompt.prompt if seq.prompt.prompt is not None else self.tokenizer.decode(seq.prompt.token_ids)

    def completion_logprobs(self, token_ids: list[int], entries: list[dict[int, float]],
                            body: CompletionRequest) -> CompletionLogprobs | None:
        if body.logprobs is None:
            return None
        out = CompletionLogprobs()
        offset = 0
        for token_id, entry in zip(token_ids, entries):
            info = self.token_info(token_id, entry[token_id])
            out.tokens.append(info["token"])
            out.token_logprobs.append(info["logprob"])
            out.top_logprobs.append({self.token_info(t, lp)["token"]: lp for t, lp in top_k(entry, body.logprobs)})
            out.text_offset.append(offset)
            offset += len(info["token"])
        return out

    # ---- running --------------------------------------------------------------------------------------------
    async def events(self, groups: list[list[Sequence]], timer: RequestTimer, head: list, delta,
                     usage_chunk) -> AsyncIterator[str]:
        """The SSE body chat and completions share: `head` chunks, one `delta(output, new_logprobs)` chunk per
        change, an error event if the engine fails the request, the usage chunk when asked for, then [DONE]."""
        for chunk in head:
            yield sse(chunk)
        choices = [Completion() for g in groups for _ in g]
        try:
            async for c, new_logprobs in self.relay(groups, choices, timer):
                if c.text_diff or c.finish_reason or new_logprobs:
                    yield sse(delta(c, new_logprobs))
        except ApiError as e:
            yield sse(ErrorResponse(error=ErrorBody(message=e.message, type=e.kind, code=e.status)))
            return
        if usage_chunk is not None:
            yield sse(usage_chunk(usage(groups, choices)))
        yield "data: [DONE]\n\n"

    async def relay(self, groups: list[list[Sequence]], choices: list[Completion], timer: RequestTimer):
        """Streams every prompt's sequences, merged; yields each completion output, tagged with its choice index,
        with the logprob entries of its new tokens. Records metrics. An engine failure becomes an ApiError. Leaving
        early (a disconnect) aborts whatever is unfinished."""
        offsets = [sum(len(g) for g in groups[:i]) for i in range(len(groups))]
        finished = False
        try:
            async for out in merge_streams([offset_index(self.llm.stream(g, streaming=True), o)
                                            for g, o in zip(groups, offsets)]):
                if out.error:
                    raise ApiError(500, f"the request failed: {out.error}", "InternalServerError")
                c = out.outputs[0]
                timer.tokens(c.index, len(c.token_ids_diff))
                yield c, choices[c.index].add(c)
            finished = True
        finally:
            timer.finished([c.finish_reason if finished else "abort" for c in choices],
                           sum(len(g[0].prompt.token_ids) for g in groups))

    async def collect(self, groups: list[list[Sequence]], timer: RequestTimer) -> list[Completion]:
        choices = [Completion() for g in groups for _ in g]
        async for _ in self.relay(groups, choices, timer):
            pass
        return choices


def top_k(entry: dict[int, float], k: int) -> list[tuple[int, float]]:
    """The k most likely tokens of a logprob entry (the sampled token plus the engine's top logprobs)."""
    return sorted(entry.items(), key=lambda kv: -kv[1])[:k]


async def offset_index(stream: AsyncIterator[RequestOutput], offset: int) -> AsyncIterator[RequestOutput]:
    async with aclosing(stream):
        async for out in stream:
            out.outputs[0].index += offset
            yield out


async def merge_streams(streams: list[AsyncIterator]) -> AsyncIterator:
    """Items of several async iterators as they arrive; closing the merge closes them all."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(stream):
        try:
            async with aclosing(stream):
                async for item in stream:
                    await queue.put(item)
        finally:
            await queue.put(done)

    tasks = [asyncio.ensure_future(pump(s)) for s in streams]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is done:
                remaining -= 1
            else:
                yield item
        for t in tasks:
            t.result()  # re-raise a stream's error
    finally:
        for t in tasks:
            t.cancel()


def usage(groups: list[list[Sequence]], choices: list[Completion]) -> Usage:
    prompt = sum(len(g[0].prompt.token_ids) for g in groups)
    completion = sum(len(c.token_ids) for c in choices)
    cached = sum(g[0].num_cached_tokens for g in groups)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details={"cached_tokens": cached})


async def until_disconnected(request: Request, work):
    """Runs `work` unless the client disconnects first, in which case it is cancelled (aborting its requests)
    and None is returned."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(wait_disconnect(request))
    done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        watch.cancel()
        return task.result()
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    return None


async def wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass

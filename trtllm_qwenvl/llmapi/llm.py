"""The user-facing LLM: generate, chat and generate_async over the engine's background loop.

Preprocessing (media decoding, the HF processor) runs in a thread pool, so async callers such as the server never
block their event loop on it, and a list of prompts is preprocessed in parallel.
"""
import asyncio
import itertools
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator, Sequence as Seq

from tqdm import tqdm

from ..config import LlmArgs
from ..engine.engine_loop import EngineLoop
from ..engine.llm_engine import LLMEngine
from ..engine.sequence import Sequence
from ..inputs.chat import build_chat_prompt
from ..inputs.media_loader import MediaLoader, MediaRules
from .outputs import RequestOutput
from .sampling_params import SamplingParams

_request_ids = itertools.count()


class LLM:
    def __init__(self, model: str, **kwargs):
        self.args = LlmArgs.from_kwargs(model=str(model), **kwargs)
        self.engine = LLMEngine(self.args)
        self.tokenizer = self.engine.tokenizer
        self.media_loader = MediaLoader(MediaRules.from_args(self.args))
        self.pool = ThreadPoolExecutor(self.args.preprocess_workers, thread_name_prefix="trtllm-qwenvl-preprocess")
        self.loop = EngineLoop(self.engine)
        self.engine.processor.on_media = self.loop.encode_early

    # ---- preparing requests ---------------------------------------------------------------------------------
    def prepare(self, prompt, params: SamplingParams | None = None, request_id: str | None = None) -> list[Sequence]:
        """Validate and preprocess one prompt into its n sequences. Raises ValueError on bad input."""
        params = params or SamplingParams()
        params.validate()
        request_id = request_id or f"req-{next(_request_ids)}"
        if params.n == 1:
            return [self.engine.make_sequence(request_id, prompt, params)]
        first = self.engine.make_sequence(f"{request_id}.0", prompt, params.for_child(0))
        # Children take the first's params, whose max_tokens the engine has already resolved.
        children = [Sequence(f"{request_id}.{i}", first.prompt, first.params.for_child(i))
                    for i in range(1, params.n)]
        for child in children:
            child.preprocess_time = first.preprocess_time
        return [first, *children]

    def chat_prompt(self, messages: list[dict], chat_template: str | None = None) -> dict:
        return build_chat_prompt(self.tokenizer, messages, self.media_loader, chat_template)

    # ---- offline --------------------------------------------------------------------------------------------
    def generate(self, prompts, sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> RequestOutput | list[RequestOutput]:
        single = not isinstance(prompts, list)
        prompts = [prompts] if single else prompts
        params = self.params_for(sampling_params, len(prompts))
        # Every prompt is validated before any is submitted: one bad prompt fails the call and runs nothing.
        groups = list(self.pool.map(self.prepare, prompts, params))
        results: dict[str, RequestOutput] = {}
        done = threading.Semaphore(0)

        def collect(out: RequestOutput):
            if out.finished:
                results[out.request_id] = out
                done.release()

        for seq in itertools.chain.from_iterable(groups):
            self.loop.submit(seq, collect)
        for group in tqdm(groups, desc="generate", disable=not use_tqdm or len(groups) == 1):
            for _ in group:
                done.acquire()
        outs = [merge([results[s.request_id] for s in group], parent_id(group)) for group in groups]
        failed = [o for o in outs if o.error]
        if failed:
            raise RuntimeError(f"request {failed[0].request_id} failed: {failed[0].error}")
        return outs[0] if single else outs

    def chat(self, messages, sampling_params: SamplingParams | None = None, use_tqdm: bool = True,
             chat_template: str | None = None):
        single = bool(messages) and isinstance(messages[0], dict)
        conversations = [messages] if single else messages
        prompts = [self.chat_prompt(conv, chat_template) for conv in conversations]
        outs = self.generate(prompts, sampling_params, use_tqdm)
        return outs[0] if single else outs

    # ---- online ---------------------------------------------------------------------------------------------
    async def generate_async(self, prompt, sampling_params: SamplingParams | None = None,
                             streaming: bool = False) -> AsyncIterator[RequestOutput]:
        """Yields each step's output when streaming, else only the final one. Cancelling aborts the request."""
        seqs = await asyncio.get_running_loop().run_in_executor(self.pool, self.prepare, prompt, sampling_params)
        async for out in self.stream(seqs, streaming):
            yield out

    async def stream(self, seqs: list[Sequence], streaming: bool) -> AsyncIterator[RequestOutput]:
        """Runs prepared sequences. Streaming yields one completion's change at a time, tagged with its index; the
        last output has `finished`. Otherwise one output with all n completions. Leaving early aborts them all."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        index = {s.request_id: i for i, s in enumerate(seqs)}
        parent = parent_id(seqs)

        # An abort's final output can arrive after the caller's event loop has closed: drop it quietly.
        def deliver(out: RequestOutput):
            if not loop.is_closed():
                loop.call_soon_threadsafe(queue.put_nowait, out)

        for seq in seqs:
            self.loop.submit(seq, deliver)
        finals: dict[str, RequestOutput] = {}
        try:
            while len(finals) < len(seqs):
                out = await queue.get()
                out.outputs[0].index = index[out.request_id]
                if out.finished:
                    finals[out.request_id] = out
                if streaming:
                    out.request_id, out.finished = parent, len(finals) == len(seqs)
                    yield out
            if not streaming:
                yield merge([finals[s.request_id] for s in seqs], parent)
        finally:
            for seq in seqs:
                if seq.request_id not in finals:
                    self.loop.abort(seq.request_id)

    def shutdown(self) -> None:
        self.loop.shutdown()
        self.pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    @staticmethod
    def params_for(sampling_params, n: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * n
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        if len(sampling_params) != n:
            raise ValueError(f"got {len(sampling_params)} sampling params for {n} prompts")
        return list(sampling_params)


def parent_id(seqs: list[Sequence]) -> str:
    rid = seqs[0].request_id
    return rid if len(seqs) == 1 else rid.rsplit(".", 1)[0]


def merge(outs: list[RequestOutput], request_id: str) -> RequestOutput:
    """One output for a prompt's n finished sequences, completions in index order."""
    first = outs[0]
    completions = [o.outputs[0] for o in outs]
    for i, c in enumerate(completions):
        c.index = i
    errors = [o.error for o in outs if o.error]
    return RequestOutput(request_id, first.prompt, first.prompt_token_ids, completions, True,
                         first.num_cached_tokens, first.metrics, errors[0] if errors else None)

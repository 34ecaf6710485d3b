"""The user-facing LLM: generate, chat and generate_async over the engine's background loop."""
import asyncio
import itertools
import threading
from typing import AsyncIterator, Sequence as Seq

from tqdm import tqdm

from ..config import LlmArgs
from ..engine.engine_loop import EngineLoop
from ..engine.llm_engine import LLMEngine
from ..inputs.chat import build_chat_prompt
from .outputs import RequestOutput
from .sampling_params import SamplingParams

_request_ids = itertools.count()


class LLM:
    def __init__(self, model: str, **kwargs):
        self.args = LlmArgs.from_kwargs(model=str(model), **kwargs)
        self.engine = LLMEngine(self.args)
        self.tokenizer = self.engine.tokenizer
        self.loop = EngineLoop(self.engine)

    def generate(self, prompts, sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> RequestOutput | list[RequestOutput]:
        single = not isinstance(prompts, list)
        prompts = [prompts] if single else prompts
        params = self.params_for(sampling_params, len(prompts))
        # Every prompt is validated before any is submitted: one bad prompt fails the call and runs nothing.
        seqs = [self.engine.make_sequence(f"req-{next(_request_ids)}", p, sp) for p, sp in zip(prompts, params)]
        results: dict[str, RequestOutput] = {}
        done = threading.Semaphore(0)

        def collect(out: RequestOutput):
            if out.finished:
                results[out.request_id] = out
                done.release()

        for seq in seqs:
            self.loop.submit(seq, collect)
        for _ in tqdm(seqs, desc="generate", disable=not use_tqdm or len(seqs) == 1):
            done.acquire()
        outs = [results[seq.request_id] for seq in seqs]
        failed = [o for o in outs if o.error]
        if failed:
            raise RuntimeError(f"request {failed[0].request_id} failed: {failed[0].error}")
        return outs[0] if single else outs

    def chat(self, messages, sampling_params: SamplingParams | None = None, use_tqdm: bool = True,
             chat_template: str | None = None):
        single = bool(messages) and isinstance(messages[0], dict)
        conversations = [messages] if single else messages
        prompts = [build_chat_prompt(self.tokenizer, conv, chat_template) for conv in conversations]
        outs = self.generate(prompts, sampling_params, use_tqdm)
        return outs[0] if single else outs

    async def generate_async(self, prompt, sampling_params: SamplingParams | None = None,
                             streaming: bool = False) -> AsyncIterator[RequestOutput]:
        """Yields each step's output when streaming, else only the final one. Cancelling aborts the request."""
        seq = self.engine.make_sequence(f"req-{next(_request_ids)}", prompt, sampling_params or SamplingParams())
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()

        # An abort's final output can arrive after the caller's event loop has closed: drop it quietly.
        def deliver(out: RequestOutput):
            if not loop.is_closed():
                loop.call_soon_threadsafe(queue.put_nowait, out)

        self.loop.submit(seq, deliver)
        finished = False
        try:
            while not finished:
                out = await queue.get()
                finished = out.finished
                if streaming or finished:
                    yield out
        finally:
            if not finished:
                self.loop.abort(seq.request_id)

    def shutdown(self) -> None:
        self.loop.shutdown()

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

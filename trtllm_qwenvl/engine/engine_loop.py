"""A background thread that steps the engine and hands each request's outputs to its callback.

Only this thread touches scheduler and KV state; callers submit ready-made sequences and abort requests.
"""
import threading
from collections import deque
from typing import Callable

from ..llmapi.outputs import RequestOutput
from ..utils.logging import logger
from .llm_engine import LLMEngine
from .sequence import Sequence


class EngineLoop:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.wake = threading.Condition()
        self.pending: deque = deque()
        self.callbacks: dict[str, Callable[[RequestOutput], None]] = {}
        self.stopped = False
        self.thread = threading.Thread(target=self.run, name="trtllm-qwenvl-engine", daemon=True)
        self.thread.start()

    def submit(self, seq: Sequence, callback: Callable[[RequestOutput], None]) -> None:
        with self.wake:
            self.pending.append(("add", seq, callback))
            self.wake.notify()

    def encode_early(self, items: list) -> None:
        """Media of a request still being preprocessed: encoded before the next step (any thread)."""
        with self.wake:
            self.pending.append(("encode", items, None))
            self.wake.notify()

    def abort(self, request_id: str) -> None:
        with self.wake:
            self.pending.append(("abort", request_id, None))
            self.wake.notify()

    def shutdown(self) -> None:
        with self.wake:
            self.stopped = True
            self.wake.notify()
        self.thread.join(timeout=10)

    def drain(self) -> list[RequestOutput]:
        with self.wake:
            while not (self.pending or self.engine.has_work() or self.stopped):
                self.wake.wait()
            commands, self.pending = list(self.pending), deque()
        outputs = []
        self.encode([item for kind, items, _ in commands if kind == "encode" for item in items])
        for kind, arg, callback in commands:
            if kind == "encode":
                continue
            if kind == "add":
                self.callbacks[arg.request_id] = callback
                self.engine.add(arg)
            else:
                out = self.engine.abort(arg)
                outputs += [out] if out else []
        return outputs

    def encode(self, items: list) -> None:
        """All announced media of one drain in one tower call. A failure only costs the head start: the requests
        encode their media again in their own steps, which report errors per request."""
        if not items:
            return
        try:
            self.engine.encode_early(items)
        except Exception:
            logger.exception("early vision encode failed")

    def run(self) -> None:
        while not self.stopped:
            try:
                outputs = self.drain()
                outputs += self.engine.step()
            except Exception:  # the loop must outlive any one bad step
                logger.exception("engine loop error")
                continue
            for out in outputs:
                self.deliver(out)

    def deliver(self, out: RequestOutput) -> None:
        callback = self.callbacks.pop(out.request_id, None) if out.finished else self.callbacks.get(out.request_id)
        if callback is None:
            return
        try:
            callback(out)
        except Exception:  # a consumer that went away (closed event loop) must not stop the engine
            logger.exception("output callback for %s failed", out.request_id)

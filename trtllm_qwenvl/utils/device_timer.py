"""Accumulated device time of a code region, measured without syncing the host.

On CUDA each region records an event pair; pairs are resolved only once their end event has completed, so reading
the total (e.g. from a metrics scrape on another thread) never waits on the GPU and the step never syncs for it.
"""
import threading
import time
from collections import deque
from contextlib import contextmanager

import torch


class DeviceTimer:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.pending: deque = deque()
        self.total = 0.0
        self.lock = threading.Lock()

    @contextmanager
    def time(self):
        if not self.cuda:
            start = time.perf_counter()
            yield
            with self.lock:
                self.total += time.perf_counter() - start
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        yield
        end.record()
        self.pending.append((start, end))

    def seconds(self) -> float:
        with self.lock:
            while self.pending and self.pending[0][1].query():
                start, end = self.pending.popleft()
                self.total += start.elapsed_time(end) / 1e3
            return self.total

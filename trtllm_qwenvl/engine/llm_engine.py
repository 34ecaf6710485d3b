"""The engine: owns the model, KV pool, scheduler and runners; turns requests into steps and steps into outputs."""
import gc
import json
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..config import LlmArgs
from ..inputs.processor import InputProcessor
from ..layers.attention_backends import select_backend
from ..llmapi.outputs import CompletionOutput, RequestMetrics, RequestOutput
from ..llmapi.sampling_params import SamplingParams
from ..models.registry import resolve
from ..utils.logging import logger
from ..utils.nvtx import nvtx_range
from .detokenizer import IncrementalDetokenizer
from .encoder_runner import EncoderRunner
from .kv_cache import BlockManager
from .state_pool import build_state_pool
from .model_runner import ModelRunner, SampledToken, kv_bytes_per_token
from .scheduler import ScheduledSeq, Scheduler
from .sequence import Sequence

CPU_DEFAULT_KV_TOKENS = 65536


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    prefix_queried_tokens: int
    prefix_hit_tokens: int
    num_preemptions: int
    vision_encoder_seconds: float
    vision_items_encoded: int


def eos_token_ids(model_dir: str, tokenizer) -> set[int]:
    ids = set()
    path = Path(model_dir) / "generation_config.json"
    if path.exists():
        eos = json.loads(path.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def build_model(args: LlmArgs, hf_config, device: torch.device, dtype: torch.dtype):
    cls = resolve(hf_config)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(hf_config)
    finally:
        torch.set_default_dtype(previous)
    if args.disable_vision_encoder:  # text-only serving of a VL checkpoint: drop the tower before its weights load
        model.visual = None
        model.skip_weights = (*model.skip_weights, "visual.")
    model.load(args.model, args.load_format)
    return model.eval().requires_grad_(False)


def freeze_startup_objects() -> None:
    """Put what start-up built (modules, compiled and captured graphs' bookkeeping) out of the garbage collector's
    reach, as vLLM and SGLang do. At the Qwen3-VL-8B shape with every graph on that is about 670k objects, and one
    full collection over them took 441 ms on an H100 host (perf/results/experiments_*): a stall of every thread,
    the engine's included. Frozen, later collections scan only what serving allocates. Garbage is collected
    first, so nothing unreachable is kept."""
    gc.collect()
    gc.freeze()


class LLMEngine:
    def __init__(self, args: LlmArgs):
        from transformers import AutoConfig
        self.args = args
        hf_config = AutoConfig.from_pretrained(args.model)
        self.device = args.torch_device()
        self.dtype = args.torch_dtype(getattr(hf_config, "dtype", None) or hf_config.text_config.dtype)
        select_backend(args.attn_backend, self.device)
        self.model = build_model(args, hf_config, self.device, self.dtype)
        self.processor = InputProcessor(args.tokenizer or args.model, hf_config, pin_pixels=self.device.type == "cuda",
                                        workers=args.preprocess_workers)
        self.tokenizer = self.processor.tokenizer
        self.eos_ids = eos_token_ids(args.model, self.tokenizer)
        self.max_seq_len = args.max_seq_len or hf_config.text_config.max_position_embeddings
        kv = args.kv_cache_config
        # Before sizing the KV pool, so on GPU the free memory it measures excludes the linear-attention state.
        self.state_pool = build_state_pool(self.model, args.max_batch_size,
                                           kv.max_state_snapshots if kv.enable_block_reuse else 0, self.device,
                                           self.dtype)
        self.log_memory("model load")
        num_blocks = self.count_kv_blocks()
        snapshots = self.state_pool.snapshots if self.state_pool else None
        # A hybrid reuses a prefix only with its state snapshot: with none kept, there is nothing to reuse.
        reuse = kv.enable_block_reuse and (self.state_pool is None or snapshots is not None)
        self.blocks = BlockManager(num_blocks, kv.tokens_per_block, reuse, snapshots)
        self.scheduler = Scheduler(self.blocks, args.max_batch_size, args.max_num_tokens, args.enable_chunked_prefill,
                                   self.state_pool)
        self.encoder = EncoderRunner(self.model, self.device, self.dtype, args.max_num_tokens)
        self.runner = ModelRunner(self.model, self.device, self.dtype, num_blocks, kv.tokens_per_block,
                                  args.max_num_tokens, args.max_batch_size, self.max_seq_len)
        self.log_memory("KV cache allocated")
        if args.torch_compile_config is not None and args.torch_compile_config.enable_piecewise_cuda_graph:
            self.runner.enable_piecewise_graphs(args.torch_compile_config)
            self.log_memory("piecewise prefill graphs captured")
        if args.cuda_graph_config is not None:
            self.runner.enable_decode_graphs(args.cuda_graph_config, args.max_batch_size,
                                             self.state_pool.scratch_slot if self.state_pool else None)
            self.log_memory("decode graphs captured")
        if args.multimodal_config.encoder_cuda_graph is not None:
            self.encoder.enable_graphs(args.multimodal_config.encoder_cuda_graph, self.dtype)
            self.log_memory("vision encoder graphs captured")
        self.states: dict[str, tuple[Sequence, IncrementalDetokenizer, RequestMetrics]] = {}
        self.overlap = not args.disable_overlap_scheduler
        self.in_flight = None  # the launched step whose tokens the next step reads (overlap scheduler)
        freeze_startup_objects()
        logger.info("loaded %s (%s) on %s: %d KV blocks x %d tokens", self.model.architecture, self.dtype,
                    self.device, num_blocks, kv.tokens_per_block)

    def log_memory(self, when: str) -> None:
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            logger.info("GPU memory after %s: %.2f GiB allocated, %.2f GiB reserved, %.2f GiB free", when,
                        torch.cuda.memory_allocated(self.device) / 2 ** 30,
                        torch.cuda.memory_reserved(self.device) / 2 ** 30, free / 2 ** 30)

    def count_kv_blocks(self) -> int:
        kv = self.args.kv_cache_config
        per_block = kv_bytes_per_token(self.model, self.dtype) * kv.tokens_per_block
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            blocks = int(free * kv.free_gpu_memory_fraction) // per_block
        else:
            blocks = -(-min(CPU_DEFAULT_KV_TOKENS, self.max_seq_len * self.args.max_batch_size)
                       // kv.tokens_per_block)
        if kv.max_tokens is not None:
            blocks = min(blocks, -(-kv.max_tokens // kv.tokens_per_block))
        if blocks <= 0:
            raise ValueError("no memory left for the KV cache")
        return blocks

    # ---- requests -------------------------------------------------------------------------------------------
    def make_sequence(self, request_id: str, prompt, params: SamplingParams) -> Sequence:
        """Validate and preprocess a request. Raises ValueError; touches no engine state, so it is thread-safe."""
        params.validate()
        if self.args.disable_vision_encoder and isinstance(prompt, dict) and prompt.get("multi_modal_data"):
            raise ValueError("this engine runs with the vision encoder disabled; media inputs are not accepted")
        start = time.perf_counter()
        processed = self.processor(prompt)
        length = len(processed.token_ids)
        if params.max_tokens is None:
            params = replace(params, max_tokens=max(self.max_seq_len - length, 1))
        if length + params.max_tokens > self.max_seq_len:
            raise ValueError(f"the prompt has {length} tokens; with max_tokens={params.max_tokens} it exceeds "
                             f"max_seq_len={self.max_seq_len}")
        if length > self.args.max_num_tokens and not self.args.enable_chunked_prefill:
            raise ValueError(f"the prompt has {length} tokens, more than max_num_tokens={self.args.max_num_tokens}; "
                             "enable chunked prefill to serve it")
        if self.blocks.blocks_needed(length + params.max_tokens) > self.blocks.num_blocks:
            raise ValueError(f"the request needs {length + params.max_tokens} tokens of KV cache, more than the "
                             f"pool's {self.blocks.num_blocks * self.blocks.block_size}")
        seq = Sequence(request_id, processed, params)
        seq.preprocess_time = time.perf_counter() - start
        return seq

    def add(self, seq: Sequence) -> None:
        if seq.request_id in self.states:
            raise ValueError(f"request id {seq.request_id!r} is already running")
        p = seq.params
        detok = IncrementalDetokenizer(self.tokenizer, seq.token_ids, p.stop, p.skip_special_tokens,
                                       p.include_stop_str_in_output)
        self.states[seq.request_id] = (seq, detok, RequestMetrics(time.time(), preprocess_time=seq.preprocess_time))
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> RequestOutput | None:
        if request_id not in self.states:
            return None
        seq = self.states[request_id][0]
        self.finish(seq, "abort")
        return self.output(seq, "", [])

    def encode_early(self, items: list) -> None:
        """Encode media announced by the input processor before their request arrives. Only while no request
        waits: the new one will then be scheduled on arrival, and its head start is TTFT; behind a queue the
        output would only sit in memory. Media the prefix cache holds are skipped (the request would then likely
        not need their embeddings)."""
        if self.model.visual is None or self.scheduler.waiting:
            return
        fresh = [item for item in items if not self.blocks.holds_media(item.hash)]
        if fresh:
            with nvtx_range("vision_encode_early"):
                self.encoder.encode_early(fresh)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self.in_flight is not None

    def stats(self) -> EngineStats:
        """A snapshot for monitoring; safe to read from another thread (plain counters and lengths)."""
        blocks = self.blocks
        return EngineStats(len(self.scheduler.running), len(self.scheduler.waiting), blocks.num_blocks,
                           blocks.num_blocks - blocks.num_free_blocks, blocks.queried_tokens, blocks.hit_tokens,
                           self.scheduler.num_preemptions, self.encoder.timer.seconds(), self.encoder.items_encoded)

    # ---- the step -------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        try:
            with nvtx_range("schedule"):
                batch = self.scheduler.schedule()
        except Exception as e:  # scheduler state is suspect: fail what it holds rather than retry it forever
            logger.exception("scheduling failed")
            return [self.fail(seq, e) for seq in [*self.scheduler.running, *self.scheduler.waiting]]
        outputs, launched = [], None
        if batch:
            try:
                media = self.encoder.prepare(batch)
                launched = self.runner.run(batch, media, self.in_flight)
            except Exception as e:  # a failed step fails its requests, frees their blocks, and the engine goes on
                logger.exception("step failed")
                outputs = [self.fail(s.seq, e) for s in batch]
        # Overlap: the previous step's tokens are read while this step runs on the GPU. They must be in place
        # before `advance` publishes this step's blocks, whose last input token may be one of them.
        done, self.in_flight = self.in_flight, None
        if done is not None:
            outputs += self.complete(done)
        if launched is not None:
            self.advance(batch, launched)
            if self.overlap:
                self.in_flight = launched
            else:
                outputs += self.complete(launched)
        return outputs

    def advance(self, batch: list[ScheduledSeq], launched) -> None:
        """Book the launched step on the host before its tokens are known: computed tokens, published blocks, and
        a placeholder for each sampled token, so the next step can be scheduled and fed from the device."""
        for s in batch:
            seq = s.seq
            if seq.is_finished:  # finished (stop string, abort) while this step was being launched
                continue
            sampled = s.samples
            seq.num_computed_tokens = s.end
            self.blocks.commit(seq)
            if sampled:
                seq.token_ids.append(0)
                seq.num_pending = 1
                seq.last_token_in_flight = (seq.num_output_tokens >= seq.params.max_tokens
                                            or len(seq) >= self.max_seq_len)

    def complete(self, launched) -> list[RequestOutput]:
        """Read a launched step's tokens into their placeholders and emit the outputs."""
        outputs = []
        for seq, tok in zip(launched.seqs, self.runner.collect(launched)):
            if seq.is_finished or not seq.num_pending:  # finished meanwhile, or its step failed
                continue
            seq.token_ids[-1] = tok.token_id
            seq.num_pending = 0
            seq.last_token_in_flight = False
            outputs.append(self.accept(seq, tok))
        return outputs

    def accept(self, seq: Sequence, tok: SampledToken) -> RequestOutput:
        _, detok, metrics = self.states[seq.request_id]
        if metrics.first_token_time is None:
            metrics.first_token_time = time.time()
        if tok.logprob is not None:
            seq.cumulative_logprob += tok.logprob
            seq.logprobs.append({tok.token_id: tok.logprob, **tok.top_logprobs})
        text, stop = detok.add(tok.token_id)
        reason = self.finish_reason(seq, tok.token_id, stop)
        if reason:
            text += detok.flush()
            self.finish(seq, reason)
        return self.output(seq, text, [tok.token_id])

    def finish_reason(self, seq: Sequence, token: int, stop_string: str | None) -> str | None:
        p = seq.params
        if stop_string is not None:
            seq.stop_reason = stop_string
            return "stop"
        if token in p.stop_token_ids:
            seq.stop_reason = token
            return "stop"
        if not p.ignore_eos and token in self.eos_ids:
            return "stop"
        if seq.num_output_tokens >= p.max_tokens or len(seq) >= self.max_seq_len:
            return "length"
        return None

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq.num_pending:  # a token still in flight is never emitted
            del seq.token_ids[-seq.num_pending:]
            seq.num_pending = 0
        seq.finish_reason = reason
        self.scheduler.finish(seq)
        self.encoder.release(seq)
        self.states[seq.request_id][2].finished_time = time.time()

    def fail(self, seq: Sequence, error: Exception) -> RequestOutput:
        self.finish(seq, "error")
        out = self.output(seq, "", [])
        out.error = f"{type(error).__name__}: {error}"
        return out

    def output(self, seq: Sequence, text_diff: str, ids_diff: list[int]) -> RequestOutput:
        _, detok, metrics = self.states[seq.request_id]
        finished = seq.is_finished
        if finished:
            del self.states[seq.request_id]
        completion = CompletionOutput(
            0, detok.text, seq.output_token_ids, seq.cumulative_logprob if seq.params.logprobs is not None else None,
            list(seq.logprobs) if seq.params.logprobs is not None else None, seq.finish_reason, seq.stop_reason,
            text_diff, ids_diff)
        return RequestOutput(seq.request_id, seq.prompt.prompt, seq.prompt.token_ids, [completion], finished,
                             seq.num_cached_tokens, metrics)

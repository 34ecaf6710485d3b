"""Engine and LLM arguments. Field names follow TensorRT-LLM's LLM API and trtllm-serve's YAML keys."""
from dataclasses import dataclass, field, fields

import torch


@dataclass
class KvCacheConfig:
    enable_block_reuse: bool = True
    tokens_per_block: int = 32
    free_gpu_memory_fraction: float = 0.9
    max_tokens: int | None = None  # cap on the pool; on CPU the pool's size
    # Hybrid models (Qwen3.5): linear-attention state snapshots kept for prefix reuse (LRU); each costs one
    # sequence's state (about 50 MiB for Qwen3.5-9B).
    max_state_snapshots: int = 32

    def __post_init__(self):
        if self.tokens_per_block <= 0:
            raise ValueError(f"tokens_per_block must be positive, got {self.tokens_per_block}")
        if self.max_state_snapshots < 0:
            raise ValueError(f"max_state_snapshots must be >= 0, got {self.max_state_snapshots}")
        if not 0 < self.free_gpu_memory_fraction <= 1:
            raise ValueError(f"free_gpu_memory_fraction must be in (0, 1], got {self.free_gpu_memory_fraction}")


@dataclass
class CudaGraphConfig:
    """Decode CUDA graphs at padded batch sizes (trtllm's `cuda_graph_config`).

    Padding is on by default (trtllm's is off) so that every decode batch up to the largest size runs a graph.
    """
    batch_sizes: list[int] | None = None
    max_batch_size: int = 0  # 0: the engine's max_batch_size
    enable_padding: bool = True


@dataclass
class TorchCompileConfig:
    """Piecewise CUDA graphs for the LM body in prefill (trtllm's `torch_compile_config`)."""
    enable_piecewise_cuda_graph: bool = False
    capture_num_tokens: list[int] | None = None


@dataclass
class EncoderCudaGraphConfig:
    """Vision-encoder CUDA graphs at token budgets: powers of two from `min_tokens` to `max_tokens` patches. A batch
    with more items than `max_items`, more frames than `max_frames`, or more patches than the largest budget runs
    eagerly."""
    min_tokens: int = 1024
    max_tokens: int = 16384
    max_items: int = 8
    max_frames: int = 64

    def __post_init__(self):
        if not 0 < self.min_tokens <= self.max_tokens:
            raise ValueError(f"encoder_cuda_graph needs 0 < min_tokens <= max_tokens, got {self.min_tokens}, "
                             f"{self.max_tokens}")


@dataclass
class MultimodalConfig:
    encoder_cuda_graph: EncoderCudaGraphConfig | None = None  # off unless given

    def __post_init__(self):
        if isinstance(self.encoder_cuda_graph, dict):
            self.encoder_cuda_graph = nested(EncoderCudaGraphConfig, "encoder_cuda_graph", self.encoder_cuda_graph)


NESTED = {"kv_cache_config": KvCacheConfig, "cuda_graph_config": CudaGraphConfig,
          "torch_compile_config": TorchCompileConfig, "multimodal_config": MultimodalConfig}


LOAD_FORMATS = ("auto", "dummy")


@dataclass
class LlmArgs:
    """Arguments of `LLM(...)` and keys of the serve YAML.

    `load_format` (as vLLM's): "auto" reads the checkpoint's safetensors; "dummy" reads none and fills every
    parameter on its device with seeded random values (norms near identity), so a directory with only config.json,
    tokenizer and processor files runs at the real model's shape, e.g. for benchmarks.
    """
    model: str
    tokenizer: str | None = None
    dtype: str = "auto"
    max_num_tokens: int = 8192
    max_batch_size: int = 64
    max_seq_len: int | None = None
    enable_chunked_prefill: bool = False
    kv_cache_config: KvCacheConfig = field(default_factory=KvCacheConfig)
    device: str | None = None
    attn_backend: str = "auto"  # triton on CUDA, torch elsewhere
    # On by default as in trtllm's PyTorch backend; None (YAML null) turns decode graphs off. CUDA only.
    cuda_graph_config: CudaGraphConfig | None = field(default_factory=CudaGraphConfig)
    torch_compile_config: TorchCompileConfig | None = None
    # As trtllm's: by default the host schedules and launches step N+1 before reading step N's tokens, which
    # then feed N+1 on the device; a sequence that stops at N has computed one token more than it keeps.
    disable_overlap_scheduler: bool = False
    multimodal_config: MultimodalConfig = field(default_factory=MultimodalConfig)
    # Media rules, named as in vLLM. Local files (file:// or bare paths) are read only under
    # `allowed_local_media_path`; http(s) only with `allow_remote_media`.
    allowed_local_media_path: str | None = None
    allow_remote_media: bool = False
    media_fetch_timeout: float = 10.0
    max_media_bytes: int = 64 << 20
    max_media_pixels: int | None = None
    limit_mm_per_prompt: dict[str, int] = field(default_factory=dict)
    media_io_kwargs: dict[str, dict] = field(default_factory=dict)
    disable_vision_encoder: bool = False
    preprocess_workers: int = 4
    load_format: str = "auto"

    @classmethod
    def from_kwargs(cls, **kwargs) -> "LlmArgs":
        known = {f.name for f in fields(cls)}
        unknown = set(kwargs) - known
        if unknown:
            raise ValueError(f"unknown LLM arguments: {sorted(unknown)}")
        for name, config_cls in NESTED.items():
            value = kwargs.get(name)
            if isinstance(value, dict):
                kwargs[name] = nested(config_cls, name, value)
        for name in ("kv_cache_config", "multimodal_config"):  # null in YAML means the defaults
            if kwargs.get(name, 0) is None:
                kwargs.pop(name)
        return cls(**kwargs)

    def __post_init__(self):
        unknown = set(self.limit_mm_per_prompt) - {"image", "video"}
        if unknown:
            raise ValueError(f"limit_mm_per_prompt has unknown modalities {sorted(unknown)}; use image and video")
        if self.preprocess_workers <= 0:
            raise ValueError(f"preprocess_workers must be positive, got {self.preprocess_workers}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"unknown load_format {self.load_format!r}; use one of {list(LOAD_FORMATS)}")

    def torch_device(self) -> torch.device:
        return torch.device(self.device or ("cuda" if torch.cuda.is_available() else "cpu"))

    def torch_dtype(self, checkpoint_dtype) -> torch.dtype:
        if self.dtype == "auto":
            dtype = checkpoint_dtype if isinstance(checkpoint_dtype, torch.dtype) else \
                getattr(torch, str(checkpoint_dtype or "bfloat16"))
            return dtype
        names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
                 "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
        if self.dtype not in names:
            raise ValueError(f"unsupported dtype {self.dtype!r}; use auto or one of {sorted(names)}")
        return names[self.dtype]


def nested(config_cls, name: str, value: dict):
    known = {f.name for f in fields(config_cls)}
    unknown = set(value) - known
    if unknown:
        raise ValueError(f"unknown {name} keys: {sorted(unknown)}; known: {sorted(known)}")
    return config_cls(**value)

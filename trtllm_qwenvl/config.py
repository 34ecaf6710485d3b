"""Engine and LLM arguments. Field names follow TensorRT-LLM's LLM API and trtllm-serve's YAML keys."""
from dataclasses import dataclass, field, fields

import torch


@dataclass
class KvCacheConfig:
    enable_block_reuse: bool = True
    tokens_per_block: int = 32
    free_gpu_memory_fraction: float = 0.9
    max_tokens: int | None = None  # cap on the pool; on CPU the pool's size

    def __post_init__(self):
        if self.tokens_per_block <= 0:
            raise ValueError(f"tokens_per_block must be positive, got {self.tokens_per_block}")
        if not 0 < self.free_gpu_memory_fraction <= 1:
            raise ValueError(f"free_gpu_memory_fraction must be in (0, 1], got {self.free_gpu_memory_fraction}")


@dataclass
class LlmArgs:
    model: str
    tokenizer: str | None = None
    dtype: str = "auto"
    max_num_tokens: int = 8192
    max_batch_size: int = 64
    max_seq_len: int | None = None
    enable_chunked_prefill: bool = False
    kv_cache_config: KvCacheConfig = field(default_factory=KvCacheConfig)
    device: str | None = None
    attn_backend: str = "torch"

    @classmethod
    def from_kwargs(cls, **kwargs) -> "LlmArgs":
        known = {f.name for f in fields(cls)}
        unknown = set(kwargs) - known
        if unknown:
            raise ValueError(f"unknown LLM arguments: {sorted(unknown)}")
        kv = kwargs.get("kv_cache_config")
        if isinstance(kv, dict):
            kwargs["kv_cache_config"] = KvCacheConfig(**kv)
        elif kv is None:
            kwargs.pop("kv_cache_config", None)
        return cls(**kwargs)

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

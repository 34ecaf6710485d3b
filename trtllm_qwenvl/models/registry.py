"""HF `architectures` name -> our model class."""
import importlib

MODELS: dict[str, type] = {}
_FAMILIES = ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")


def register(architecture: str):
    def wrap(cls):
        MODELS[architecture] = cls
        cls.architecture = architecture
        return cls
    return wrap


def resolve(hf_config) -> type:
    for family in _FAMILIES:
        importlib.import_module(f"{__package__}.{family}")
    names = list(getattr(hf_config, "architectures", None) or [])
    for name in names:
        if name in MODELS:
            return MODELS[name]
    raise ValueError(f"unsupported architecture {names or hf_config.model_type!r}; supported: {sorted(MODELS)}")

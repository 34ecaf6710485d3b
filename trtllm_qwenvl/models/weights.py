"""Load HF safetensors checkpoints into our modules through an explicit per-family name map."""
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from torch import nn

from ..layers.norm import ZeroCenteredRMSNorm
from ..utils.logging import logger

# Published Qwen checkpoints come in two layouts: `visual.*` + `model.*` (Qwen2.5-VL) and
# `model.visual.*` + `model.language_model.*` (Qwen3-VL, transformers >= 4.52 saves). Both normalise to ours.
PREFIXES = [(r"^model\.visual\.", "visual."), (r"^model\.language_model\.", "language_model."),
            (r"^model\.(?!language_model|visual)", "language_model.")]


@dataclass(frozen=True)
class Rule:
    """Rename `pattern` -> `repl`; `shard` names a slice of a fused parameter; `transform` reshapes the tensor."""
    pattern: str
    repl: str
    shard: str | None = None
    transform: str | None = None


LM_RULES = [
    Rule(r"\.self_attn\.([qkv])_proj\.", r".self_attn.qkv_proj.", shard="\\1"),
    Rule(r"\.mlp\.gate_proj\.", ".mlp.gate_up_proj.", shard="gate"),
    Rule(r"\.mlp\.up_proj\.", ".mlp.gate_up_proj.", shard="up"),
    Rule(r"\.mlp\.experts\.gate_up_proj$", ".mlp.w13", transform="experts"),
    Rule(r"\.mlp\.experts\.down_proj$", ".mlp.w2", transform="experts"),
    # Per-expert tensors (Qwen3.5-MoE as published and as HF saves it) fill rows of the stacked expert weights.
    Rule(r"\.mlp\.experts\.(\d+)\.(gate|up)_proj\.weight$", ".mlp.w13", shard="\\1.\\2"),
    Rule(r"\.mlp\.experts\.(\d+)\.down_proj\.weight$", ".mlp.w2", shard="\\1"),
    Rule(r"\.shared_expert\.gate_proj\.", ".shared_expert.gate_up_proj.", shard="gate"),
    Rule(r"\.shared_expert\.up_proj\.", ".shared_expert.gate_up_proj.", shard="up"),
    Rule(r"\.linear_attn\.in_proj_(qkv|z|b|a)\.", ".linear_attn.in_proj.", shard="\\1"),
    Rule(r"\.linear_attn\.conv1d\.weight$", ".linear_attn.conv_weight", transform="conv_as_linear"),
]


def iterate_checkpoint(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no safetensors weights found in {model_dir}; pass load_format='dummy' to run it with "
                         "random weights")
    for name in files:
        with safe_open(model_dir / name, framework="pt") as f:
            for key in f.keys():
                yield key, f.get_tensor(key)


def normalise(name: str) -> str:
    for pattern, repl in PREFIXES:
        name, n = re.subn(pattern, repl, name)
        if n:
            break
    return name


def apply_rules(name: str, rules: list[Rule]) -> tuple[str, str | None, str | None]:
    for rule in rules:
        new, n = re.subn(rule.pattern, rule.repl, name)
        if n:
            shard = re.sub(rule.pattern, rule.shard, re.search(rule.pattern, name).group(0)) if rule.shard else None
            return new, shard, rule.transform
    return name, None, None


def transform(tensor: torch.Tensor, kind: str | None, shape: torch.Size) -> torch.Tensor:
    if kind == "conv_as_linear":
        return tensor.reshape(tensor.shape[0], -1)
    if kind == "experts" and tensor.shape != shape:
        # HF stores Qwen3-VL-MoE experts as (E, in, out); a tensor already in our (E, out, in) is kept, as HF does.
        return tensor.transpose(1, 2)
    return tensor


def copy_into(param: nn.Parameter, tensor: torch.Tensor, shard: str | None, name: str) -> None:
    """A shard is a row range of the parameter seen as 2-D (leading dims flattened, so stacked experts too)."""
    target = param.data
    if shard is not None:
        start, size = param.shards[shard]
        target = (target.flatten(0, -2) if target.dim() > 2 else target).narrow(0, start, size)
    if target.shape != tensor.shape:
        raise ValueError(f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
    target.copy_(tensor)


def load_weights(model: nn.Module, model_dir: str | Path, rules: list[Rule], skip: tuple[str, ...] = (),
                 tied: dict[str, str] | None = None) -> None:
    """Copy every checkpoint tensor into its parameter. Unknown and missing tensors are errors naming the tensor.

    `skip` lists regexes of checkpoint tensors we do not use; `tied` maps parameters to the one they share.
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    expected = {(n, s) for n, p in params.items() for s in (getattr(p, "shards", None) or [None])}
    loaded = set()
    skipped = 0
    for raw, tensor in iterate_checkpoint(model_dir):
        if any(re.search(p, raw) for p in skip):
            skipped += 1
            continue
        name, shard, kind = apply_rules(normalise(raw), rules)
        if tied and name in tied:
            continue
        if name not in params:
            raise ValueError(f"checkpoint tensor {raw!r} has no matching parameter (mapped to {name!r})")
        param = params[name]
        copy_into(param, transform(tensor, kind, param.shape).to(param.dtype), shard, raw)
        if shard is None and getattr(param, "shards", None):
            loaded.update((name, s) for s in param.shards)  # a fused tensor fills every shard at once
        else:
            loaded.add((name, shard))
    missing = sorted(f"{n}[{s}]" if s else n for n, s in expected - loaded if not (tied and n in tied))
    if missing:
        raise ValueError(f"checkpoint {model_dir} lacks weights for: {', '.join(missing[:8])}"
                         + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))
    if skipped:
        logger.info("ignored %d checkpoint tensors matching %s", skipped, skip)


# (mean, std) of dummy weights by parameter name: Gated DeltaNet's decay stays sane (A_log near -3 with dt_bias
# near 1 gives a per-token decay near 0.95), so the recurrent state neither vanishes nor blows up.
DUMMY_INIT = {"A_log": (-3.0, 0.1), "dt_bias": (1.0, 0.1)}
DUMMY_STD = 0.02


def dummy_init(module: nn.Module, leaf: str) -> tuple[float, float]:
    if leaf in DUMMY_INIT:
        return DUMMY_INIT[leaf]
    if "Norm" not in type(module).__name__:
        return 0.0, DUMMY_STD
    # Norm weights near identity: 1 for plain norms, 0 for zero-centred (1 + w) ones; biases near 0.
    return (0.0 if leaf != "weight" or isinstance(module, ZeroCenteredRMSNorm) else 1.0), DUMMY_STD


@torch.no_grad()
def randomize_weights(model: nn.Module, seed: int = 0) -> None:
    """Fill every parameter in place on its own device with seeded normal noise (load_format="dummy")."""
    generators: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():  # a tied parameter comes once
        if param.is_meta:
            continue
        owner, _, leaf = name.rpartition(".")
        mean, std = dummy_init(model.get_submodule(owner), leaf)
        if param.device not in generators:
            generators[param.device] = torch.Generator(param.device).manual_seed(seed)
        param.normal_(mean, std, generator=generators[param.device])

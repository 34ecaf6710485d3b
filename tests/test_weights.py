"""Checkpoint loading: name normalisation, fused q/k/v shards, errors naming tensors, skip, tied and experts."""
import json

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from trtllm_qwenvl import LLM, SamplingParams
from trtllm_qwenvl.config import LlmArgs
from trtllm_qwenvl.layers.norm import RMSNorm, ZeroCenteredRMSNorm
from trtllm_qwenvl.models import tiny
from trtllm_qwenvl.models.weights import LM_RULES, Rule, apply_rules, load_weights, normalise, randomize_weights

HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 4, 2, 1, 2
Q_ROWS, KV_ROWS = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM  # 4, 2


class SelfAttn(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv_proj = nn.Linear(HIDDEN, Q_ROWS + 2 * KV_ROWS, bias=True)
        self.o_proj = nn.Linear(Q_ROWS, HIDDEN, bias=False)
        shards = {"q": (0, Q_ROWS), "k": (Q_ROWS, KV_ROWS), "v": (Q_ROWS + KV_ROWS, KV_ROWS)}
        for p in self.qkv_proj.parameters():
            p.shards = shards  # as layers/attention.py declares them


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn = SelfAttn()


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Layer()])


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.language_model = LM()
        self.visual = nn.Module()
        self.visual.proj = nn.Linear(3, 2, bias=False)


def checkpoint_tensors(prefix="model.layers.0.self_attn.", visual="model.visual."):
    g = torch.Generator().manual_seed(0)
    t = {}
    for name, rows in (("q", Q_ROWS), ("k", KV_ROWS), ("v", KV_ROWS)):
        t[f"{prefix}{name}_proj.weight"] = torch.randn(rows, HIDDEN, generator=g)
        t[f"{prefix}{name}_proj.bias"] = torch.randn(rows, generator=g)
    t[f"{prefix}o_proj.weight"] = torch.randn(HIDDEN, Q_ROWS, generator=g)
    t[f"{visual}proj.weight"] = torch.randn(2, 3, generator=g)
    return t


def write(tmp_path, tensors, files=2):
    """Spread `tensors` over `files` safetensors files (no index: the loader globs them)."""
    names = sorted(tensors)
    for i in range(files):
        part = {n: tensors[n].contiguous() for n in names[i::files]}
        if part:
            save_file(part, str(tmp_path / f"model-{i:05d}.safetensors"))
    return tmp_path


def load(tmp_path, tensors, model=None, **kwargs):
    model = model or Tiny()
    load_weights(model, write(tmp_path, tensors), LM_RULES, **kwargs)
    return model


# ---- normalise ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("raw,expected", [
    ("model.visual.blocks.0.attn.qkv.weight", "visual.blocks.0.attn.qkv.weight"),
    ("model.language_model.layers.0.mlp.up_proj.weight", "language_model.layers.0.mlp.up_proj.weight"),
    ("model.language_model.embed_tokens.weight", "language_model.embed_tokens.weight"),
    ("model.layers.3.input_layernorm.weight", "language_model.layers.3.input_layernorm.weight"),
    ("model.embed_tokens.weight", "language_model.embed_tokens.weight"),
    ("model.norm.weight", "language_model.norm.weight"),
    ("visual.merger.mlp.0.weight", "visual.merger.mlp.0.weight"),
    ("lm_head.weight", "lm_head.weight"),
])
def test_normalise_prefixes(raw, expected):
    assert normalise(raw) == expected


def test_rules_map_q_k_v_and_gate_up_to_shards():
    assert apply_rules("language_model.layers.1.self_attn.k_proj.bias", LM_RULES) == (
        "language_model.layers.1.self_attn.qkv_proj.bias", "k", None)
    assert apply_rules("language_model.layers.0.mlp.up_proj.weight", LM_RULES) == (
        "language_model.layers.0.mlp.gate_up_proj.weight", "up", None)
    assert apply_rules("language_model.layers.0.mlp.experts.down_proj", LM_RULES) == (
        "language_model.layers.0.mlp.w2", None, "experts")


# ---- fused q/k/v -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["qwen2_5_vl", "qwen3_vl"])
def test_qkv_shards_land_in_their_rows(tmp_path, layout):
    if layout == "qwen2_5_vl":
        t = checkpoint_tensors("model.layers.0.self_attn.", "visual.")
    else:
        t = checkpoint_tensors("model.language_model.layers.0.self_attn.", "model.visual.")
    p = next(k for k in t if k.endswith("q_proj.weight"))[:-len("q_proj.weight")]
    model = load(tmp_path, t)
    qkv = model.language_model.layers[0].self_attn.qkv_proj
    assert torch.equal(qkv.weight[:4], t[p + "q_proj.weight"])
    assert torch.equal(qkv.weight[4:6], t[p + "k_proj.weight"])
    assert torch.equal(qkv.weight[6:8], t[p + "v_proj.weight"])
    assert torch.equal(qkv.bias, torch.cat([t[p + "q_proj.bias"], t[p + "k_proj.bias"], t[p + "v_proj.bias"]]))
    assert torch.equal(model.language_model.layers[0].self_attn.o_proj.weight, t[p + "o_proj.weight"])
    visual = next(k for k in t if k.endswith("proj.weight") and "visual" in k)
    assert torch.equal(model.visual.proj.weight, t[visual])


def test_dtype_is_converted_to_the_parameter_dtype(tmp_path):
    t = {k: v.to(torch.bfloat16) for k, v in checkpoint_tensors().items()}
    model = load(tmp_path, t)
    w = model.language_model.layers[0].self_attn.qkv_proj.weight
    assert w.dtype == torch.float32
    assert torch.equal(w[4:6], t["model.layers.0.self_attn.k_proj.weight"].float())


def test_index_file_selects_the_shards(tmp_path):
    t = checkpoint_tensors()
    save_file(t, str(tmp_path / "weights.safetensors"))
    save_file({"model.bogus.weight": torch.zeros(1)}, str(tmp_path / "stray.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {k: "weights.safetensors" for k in t}}))
    model = Tiny()
    load_weights(model, tmp_path, LM_RULES)  # the stray file is not in the index, so it is not read
    assert torch.equal(model.visual.proj.weight, t["model.visual.proj.weight"])


# ---- errors ------------------------------------------------------------------------------------------------
def test_unknown_tensor_raises_naming_it(tmp_path):
    t = checkpoint_tensors()
    t["model.layers.0.self_attn.extra_proj.weight"] = torch.zeros(2, 2)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.extra_proj\.weight"):
        load(tmp_path, t)


def test_missing_shard_raises_naming_it(tmp_path):
    t = checkpoint_tensors()
    del t["model.layers.0.self_attn.v_proj.weight"]
    with pytest.raises(ValueError, match=r"language_model\.layers\.0\.self_attn\.qkv_proj\.weight\[v\]"):
        load(tmp_path, t)


def test_missing_plain_tensor_raises_naming_it(tmp_path):
    t = checkpoint_tensors()
    del t["model.layers.0.self_attn.o_proj.weight"]
    with pytest.raises(ValueError, match=r"language_model\.layers\.0\.self_attn\.o_proj\.weight"):
        load(tmp_path, t)


def test_shape_mismatch_raises_naming_it(tmp_path):
    t = checkpoint_tensors()
    t["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(3, HIDDEN)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight.*\(3, 4\).*\(2, 4\)"):
        load(tmp_path, t)


def test_no_safetensors_raises(tmp_path):
    with pytest.raises(ValueError, match="no safetensors"):
        load_weights(Tiny(), tmp_path, LM_RULES)


# ---- skip, tied --------------------------------------------------------------------------------------------
def test_skip_patterns_are_ignored(tmp_path):
    t = checkpoint_tensors()
    t["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(2)
    t["mtp.layers.0.weight"] = torch.ones(2)
    model = load(tmp_path, t, skip=(r"rotary_emb\.inv_freq$", r"^mtp\."))
    assert torch.equal(model.visual.proj.weight, t["model.visual.proj.weight"])


def test_unskipped_extra_tensor_is_an_error(tmp_path):
    t = checkpoint_tensors()
    t["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(2)
    with pytest.raises(ValueError, match="inv_freq"):
        load(tmp_path, t, skip=(r"^mtp\.",))


class TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.language_model = nn.Module()
        self.language_model.embed_tokens = nn.Embedding(5, 3)
        self.lm_head = nn.Linear(3, 5, bias=False)
        self.lm_head.weight = self.language_model.embed_tokens.weight


def test_tied_parameter_is_not_required_and_checkpoint_copy_is_ignored(tmp_path):
    embed = torch.randn(5, 3)
    tied = {"lm_head.weight": "language_model.embed_tokens.weight"}
    model = load(tmp_path, {"model.embed_tokens.weight": embed, "lm_head.weight": torch.zeros(5, 3)},
                 model=TiedLM(), tied=tied)
    assert torch.equal(model.lm_head.weight, embed)
    assert torch.equal(model.language_model.embed_tokens.weight, embed)


# ---- experts -----------------------------------------------------------------------------------------------
class MoE(nn.Module):
    def __init__(self, experts=2, hidden=4, inter=3):
        super().__init__()
        layer = nn.Module()
        layer.mlp = nn.Module()
        layer.mlp.w13 = nn.Parameter(torch.zeros(experts, 2 * inter, hidden))  # (E, out, in)
        layer.mlp.w2 = nn.Parameter(torch.zeros(experts, hidden, inter))
        self.language_model = nn.Module()
        self.language_model.layers = nn.ModuleList([layer])


def test_experts_transposed_from_hf_layout(tmp_path):
    gate_up = torch.randn(2, 4, 6)  # HF: (E, in=hidden, out=2*inter)
    down = torch.randn(2, 3, 4)     # HF: (E, in=inter, out=hidden)
    model = load(tmp_path, {"model.language_model.layers.0.mlp.experts.gate_up_proj": gate_up,
                            "model.language_model.layers.0.mlp.experts.down_proj": down}, model=MoE())
    mlp = model.language_model.layers[0].mlp
    assert torch.equal(mlp.w13, gate_up.transpose(1, 2))
    assert torch.equal(mlp.w2, down.transpose(1, 2))


def test_experts_already_in_our_layout_are_kept(tmp_path):
    gate_up = torch.randn(2, 6, 4)
    down = torch.randn(2, 4, 3)
    model = load(tmp_path, {"model.language_model.layers.0.mlp.experts.gate_up_proj": gate_up,
                            "model.language_model.layers.0.mlp.experts.down_proj": down}, model=MoE())
    mlp = model.language_model.layers[0].mlp
    assert torch.equal(mlp.w13, gate_up)
    assert torch.equal(mlp.w2, down)


def test_custom_rule_renames_before_lookup(tmp_path):
    t = checkpoint_tensors()
    w = t.pop("model.visual.proj.weight")
    t["model.visual.old_proj.weight"] = w
    model = Tiny()
    load_weights(model, write(tmp_path, t), [Rule(r"^visual\.old_proj\.", "visual.proj.")] + LM_RULES)
    assert torch.equal(model.visual.proj.weight, w)


# ---- load_format="dummy" -----------------------------------------------------------------------------------
def config_only_dir(tmp_path):
    """A tiny Qwen3-VL checkpoint with its weights removed: config, tokenizer and processor files only."""
    model_dir = tiny.make_tiny("qwen3_vl", tmp_path / "ckpt")
    for path in model_dir.glob("model*.safetensors*"):
        path.unlink()
    return model_dir


def test_dummy_load_format_runs_without_weights(tmp_path):
    model_dir = config_only_dir(tmp_path)
    with LLM(model_dir, dtype="float32", load_format="dummy", max_seq_len=256) as llm:
        norms = [m.weight for m in llm.engine.model.modules() if type(m).__name__ == "RMSNorm"]
        out = llm.generate("Hello there", SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4
    weights = torch.cat([w.flatten() for w in norms])
    assert abs(weights.mean().item() - 1) < 0.01 and 0 < weights.std().item() < 0.1  # near identity, not identity


def test_auto_load_format_without_weights_says_so(tmp_path):
    with pytest.raises(ValueError, match="load_format='dummy'"):
        LLM(config_only_dir(tmp_path), dtype="float32")


def test_dummy_weights_are_seeded_and_centred_per_norm_kind():
    def build():
        model = nn.Sequential(nn.Linear(8, 8), RMSNorm(8), ZeroCenteredRMSNorm(8), nn.LayerNorm(8))
        randomize_weights(model, seed=3)
        return model
    a, b = build(), build()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    means = [round(p.mean().item()) for p in a.parameters()]
    assert means == [0, 0, 1, 0, 1, 0]  # linear w/b, RMSNorm, zero-centred RMSNorm, LayerNorm w/b


def test_unknown_load_format_is_rejected():
    with pytest.raises(ValueError, match="load_format"):
        LlmArgs(model="unused", load_format="pt")

"""Hybrid (Qwen3.5) prefix caching on CPU: how many prompt tokens the state snapshots let a request reuse, and
what a snapshot costs at real shapes.

A hybrid prefix hit needs a linear-attention state snapshot at its last block, so hits stop at the boundaries
where snapshots are saved (the end of each media item, the last reusable boundary of each prompt), not at the
longest cached block as for attention-only models. Each workload runs on a fresh tiny fp32 qwen3_5 checkpoint
with prefix caching on and off; greedy tokens must be identical, or the script exits non-zero.

    HF_HUB_OFFLINE=1 .venv/bin/python perf/bench_hybrid_prefix.py
"""
import datetime
import pathlib
import subprocess
import sys
import time

import torch
import transformers
from PIL import Image

from trtllm_qwenvl import LLM, SamplingParams
from trtllm_qwenvl.engine.state_pool import bytes_per_slot
from trtllm_qwenvl.layers.gated_deltanet import GatedDeltaNet
from trtllm_qwenvl.models import tiny

ROOT = pathlib.Path(__file__).resolve().parents[1]
CHECKPOINT = ROOT / ".cache" / "tiny" / "qwen3_5"
BLOCK = 16
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)  # fixed length: outputs comparable
SYSTEM = ("You are a careful visual assistant. Answer in one short sentence, name colours and shapes exactly, "
          "and say so when something is not visible in the picture.")
QUESTIONS = ["What shapes are in the image?", "Which colour dominates?", "Is there a circle?",
             "Where is the green square?", "How many shapes are there?", "Describe the background.",
             "Is there any text?", "What is at the bottom?"]
CONTROL = "(c) control: 8 different images"
SNAPSHOTS_DEFAULT = 32  # kv_cache_config.max_state_snapshots


def user(parts: list, text: str) -> dict:
    return {"role": "user", "content": [{"type": p} for p in parts] + [{"type": "text", "text": text}]}


def prompt(llm: LLM, messages: list[dict], images: list[Image.Image]) -> dict:
    text = llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return {"prompt": text, "multi_modal_data": {"image": images}} if images else {"prompt": text}


def run_questions(llm: LLM, image: Image.Image) -> list:
    """(a) the same system prompt and image, a different question each time, one request after another."""
    system = {"role": "system", "content": SYSTEM}
    return [llm.generate(prompt(llm, [system, user(["image"], q)], [image]), GREEDY, use_tqdm=False)
            for q in QUESTIONS]


def run_chat(llm: LLM, image: Image.Image) -> list:
    """(b) a 4-turn chat: each turn re-sends the whole history (its own earlier replies) plus a new question."""
    messages, outs = [{"role": "system", "content": SYSTEM}], []
    for turn, question in enumerate(QUESTIONS[:4]):
        messages.append(user(["image"] if turn == 0 else [], question))
        out = llm.generate(prompt(llm, messages, [image]), GREEDY, use_tqdm=False)
        messages.append({"role": "assistant", "content": out.outputs[0].text})
        outs.append(out)
    return outs


def variants(image: Image.Image) -> list[Image.Image]:
    """8 different images: the sample and its mirror image, each turned by 0, 90, 180 and 270 degrees."""
    mirror = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return [img.rotate(angle, expand=True) for img in (image, mirror) for angle in (0, 90, 180, 270)]


def run_control(llm: LLM, image: Image.Image) -> list:
    """(c) control: a different image each time with the same question; nothing past the text before it may hit."""
    system = {"role": "system", "content": SYSTEM}
    return [llm.generate(prompt(llm, [system, user(["image"], QUESTIONS[0])], [img]), GREEDY, use_tqdm=False)
            for img in variants(image)]


def text_before_image(llm: LLM, out) -> int:
    """Full blocks before the first image token: the most a different image may reuse."""
    ids = out.prompt_token_ids
    return ids.index(llm.engine.processor.spec.image_token_id) // BLOCK * BLOCK


def measure(workload, image: Image.Image) -> dict:
    """Run `workload` with prefix caching on and off; token counts, hit rates and the on/off token check."""
    runs = {}
    for reuse in (True, False):
        with LLM(str(CHECKPOINT), dtype="float32",
                 kv_cache_config={"tokens_per_block": BLOCK, "enable_block_reuse": reuse}) as llm:
            start = time.perf_counter()
            outs = workload(llm, image)
            runs[reuse] = (outs, time.perf_counter() - start, [text_before_image(llm, o) for o in outs])
    outs, seconds_on, before_image = runs[True]
    prompt_tokens = [len(o.prompt_token_ids) for o in outs]
    cached = [o.num_cached_tokens for o in outs]
    mismatches = [i for i, (a, b) in enumerate(zip(outs, runs[False][0]))
                  if a.outputs[0].token_ids != b.outputs[0].token_ids]
    return {"requests": len(outs), "prompt": sum(prompt_tokens), "cached": sum(cached),
            "hit": sum(cached) / sum(prompt_tokens), "hit_after_first": sum(cached[1:]) / sum(prompt_tokens[1:]),
            "per_request": cached, "mismatches": mismatches, "seconds": (seconds_on, runs[False][1]),
            "before_image": before_image,
            "past_text": [i for i, (c, b) in enumerate(zip(cached, before_image)) if c > b]}


def gdn_layers(text) -> list[GatedDeltaNet]:
    """The config's Gated DeltaNet layers on the meta device: shapes without memory."""
    with torch.device("meta"):
        return [GatedDeltaNet(text.hidden_size, text.linear_num_key_heads, text.linear_num_value_heads,
                              text.linear_key_head_dim, text.linear_value_head_dim, text.linear_conv_kernel_dim,
                              text.rms_norm_eps)
                for kind in text.layer_types if kind == "linear_attention"]


def snapshot_memory() -> list[tuple[str, int, float]]:
    """(config, linear layers, MiB per snapshot) with a bf16 conv state and the fp32 recurrent state."""
    rows = []
    for name, text in (("Qwen3.5 (Qwen3_5TextConfig defaults)", transformers.Qwen3_5TextConfig()),
                       ("Qwen3.5-MoE (Qwen3_5MoeTextConfig defaults)", transformers.Qwen3_5MoeTextConfig())):
        layers = gdn_layers(text)
        rows.append((name, len(layers), bytes_per_slot(layers, torch.bfloat16) / 2 ** 20))
    return rows


def report(results: dict, memory: list) -> str:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    if subprocess.run(["git", "status", "--porcelain", "--", "trtllm_qwenvl"], cwd=ROOT, capture_output=True,
                      text=True).stdout.strip():
        commit += " + uncommitted changes to trtllm_qwenvl/"
    lines = [f"# Hybrid prefix caching: tiny Qwen3.5 on CPU, {datetime.date.today()}, commit {commit}", "",
             f"Machine: CPU, 2 cores. Tiny fp32 `qwen3_5` checkpoint (`tiny.make_tiny`), `tokens_per_block={BLOCK}`, "
             f"greedy, {GREEDY.max_tokens} output tokens, requests sent one after another; a fresh LLM per "
             "workload and mode. Cached = `RequestOutput.num_cached_tokens`.", "",
             "| workload | requests | prompt tokens | cached tokens | hit rate | hit rate w/o first | "
             "cached per request | tokens on = off | wall s on / off |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        same = "yes" if not r["mismatches"] else f"NO: requests {r['mismatches']}"
        lines.append(f"| {name} | {r['requests']} | {r['prompt']} | {r['cached']} | {r['hit']:.1%} | "
                     f"{r['hit_after_first']:.1%} | {' '.join(map(str, r['per_request']))} | {same} | "
                     f"{r['seconds'][0]:.1f} / {r['seconds'][1]:.1f} |")
    control = results[CONTROL]
    lines += ["", f"Control: cached tokens never exceed the full blocks of text before the image "
              f"({' '.join(map(str, control['before_image']))} tokens per request): "
              f"{'yes' if not control['past_text'] else 'NO: requests ' + str(control['past_text'])}."]
    lines += ["", "Memory per state snapshot at real shapes (conv state bf16, recurrent state fp32; "
              "`engine/state_pool.bytes_per_slot`):", "",
              f"| config | linear-attention layers | MiB per snapshot | MiB for {SNAPSHOTS_DEFAULT} snapshots |",
              "|---|---|---|---|"]
    lines += [f"| {name} | {n} | {mib:.1f} | {mib * SNAPSHOTS_DEFAULT:.0f} |" for name, n, mib in memory]
    return "\n".join(lines) + "\n"


def main() -> int:
    torch.set_num_threads(2)
    if not (CHECKPOINT / "config.json").exists():
        tiny.make_tiny("qwen3_5", CHECKPOINT, seed=0)
    image = Image.open(ROOT / "examples" / "media" / "sample.png").convert("RGB")
    results = {"(a) system + same image, 8 questions": measure(run_questions, image),
               "(b) 4-turn chat, history re-sent": measure(run_chat, image),
               CONTROL: measure(run_control, image)}
    text = report(results, snapshot_memory())
    print(text)
    out = ROOT / "perf" / "results" / f"hybrid_prefix_cpu_{datetime.date.today()}.md"
    out.write_text(text)
    print(f"wrote {out.relative_to(ROOT)}")
    failed = False
    for name, r in results.items():
        if r["mismatches"]:
            print(f"!!! MISMATCH in {name}: generated tokens differ with prefix caching on vs off for requests "
                  f"{r['mismatches']}", file=sys.stderr)
            failed = True
    if results[CONTROL]["past_text"]:
        print("!!! FALSE HIT in the control: a different image reused tokens past the text before it",
              file=sys.stderr)
        failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

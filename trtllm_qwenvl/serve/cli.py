"""`trtllm-qwenvl serve MODEL_DIR`: trtllm-serve's flags and YAML, plus vLLM-named media flags.

Flags set LLM arguments; the YAML file (`--extra_llm_api_options` / `--config`) holds any LLM argument by its
LlmArgs name and overrides the flags, as in trtllm-serve.
"""
import argparse
import json
import logging
from pathlib import Path

import yaml

from ..utils.logging import logger

# flag -> LLM argument, for the flags that map one to one
LLM_FLAGS = ("tokenizer", "dtype", "max_batch_size", "max_num_tokens", "max_seq_len", "allowed_local_media_path",
             "allow_remote_media", "limit_mm_per_prompt", "media_io_kwargs", "max_media_pixels",
             "disable_vision_encoder", "enable_chunked_prefill", "preprocess_workers")


def json_arg(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from e
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="trtllm-qwenvl serve", description="OpenAI-compatible server for Qwen VL models")
    p.add_argument("model", help="HF checkpoint directory")
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--host", default="localhost")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--backend", default="pytorch", choices=["pytorch"])
    p.add_argument("--dtype", default=None)
    p.add_argument("--max_batch_size", type=int, default=None)
    p.add_argument("--max_num_tokens", type=int, default=None)
    p.add_argument("--max_seq_len", type=int, default=None)
    p.add_argument("--tp_size", type=int, default=1)
    p.add_argument("--kv_cache_free_gpu_memory_fraction", type=float, default=None)
    p.add_argument("--enable_chunked_prefill", action="store_true", default=None)
    p.add_argument("--served_model_name", default=None)
    p.add_argument("--chat_template", default=None, help="a Jinja template, or a file holding one")
    p.add_argument("--media_io_kwargs", type=json_arg, default=None, help='e.g. \'{"video": {"num_frames": 8}}\'')
    p.add_argument("--trust_remote_code", action="store_true", help="accepted; no remote code is ever run")
    p.add_argument("--extra_llm_api_options", "--config", dest="config", default=None, help="YAML of LLM arguments")
    p.add_argument("--allowed_local_media_path", default=None, help="file:// media is read only under this dir")
    p.add_argument("--allow_remote_media", action="store_true", default=None, help="allow http(s) media URLs")
    p.add_argument("--limit_mm_per_prompt", type=json_arg, default=None, help='e.g. \'{"image": 8, "video": 2}\'')
    p.add_argument("--max_media_pixels", type=int, default=None)
    p.add_argument("--disable_vision_encoder", action="store_true", default=None,
                   help="serve a VL checkpoint text-only; media requests get a 400")
    p.add_argument("--preprocess_workers", type=int, default=None)
    p.add_argument("--log_level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def llm_kwargs(args: argparse.Namespace) -> dict:
    if args.tp_size != 1:
        raise SystemExit("tensor parallelism is not supported: use --tp_size 1")
    kwargs = {k: getattr(args, k) for k in LLM_FLAGS if getattr(args, k) is not None}
    if args.kv_cache_free_gpu_memory_fraction is not None:
        kwargs["kv_cache_config"] = {"free_gpu_memory_fraction": args.kv_cache_free_gpu_memory_fraction}
    if args.config:
        options = yaml.safe_load(Path(args.config).read_text()) or {}
        if not isinstance(options, dict):
            raise SystemExit(f"{args.config}: expected a mapping of LLM arguments")
        kv = {**kwargs.get("kv_cache_config", {}), **(options.pop("kv_cache_config", None) or {})}
        kwargs.update(options)
        if kv:
            kwargs["kv_cache_config"] = kv
    return kwargs


def read_template(value: str | None) -> str | None:
    if value is None:
        return None
    path = Path(value)
    return path.read_text() if path.is_file() else value


def main(argv: list[str]) -> None:
    import uvicorn

    from ..llmapi.llm import LLM
    from .openai_server import OpenAIServer

    args = parser().parse_args(argv)
    logging.getLogger().setLevel(args.log_level.upper())
    logger.setLevel(args.log_level.upper())
    try:
        llm = LLM(args.model, **llm_kwargs(args))
    except ValueError as e:
        raise SystemExit(f"trtllm-qwenvl serve: {e}") from e
    if not llm.args.disable_vision_encoder:
        llm.engine.processor.processor  # load the HF processor now rather than on the first media request
    name = args.served_model_name or args.model
    server = OpenAIServer(llm, name, read_template(args.chat_template))
    engine = llm.engine
    print(f"trtllm-qwenvl serve: model {name} ({engine.model.architecture}, {engine.dtype}, {engine.device}), "
          f"{engine.blocks.num_blocks} KV blocks x {engine.blocks.block_size} tokens, "
          f"listening on http://{args.host}:{args.port}", flush=True)
    try:
        uvicorn.run(server.app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        llm.shutdown()

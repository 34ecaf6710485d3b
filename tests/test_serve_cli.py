"""`trtllm-qwenvl serve`: flags and YAML -> LLM arguments, and one real start of the server."""
import os
import queue
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
import yaml

from trtllm_qwenvl.config import CudaGraphConfig, KvCacheConfig, LlmArgs, TorchCompileConfig
from trtllm_qwenvl.models import tiny
from trtllm_qwenvl.serve.cli import llm_kwargs, parser


def kwargs_for(*argv, config: dict | None = None, tmp_path=None) -> dict:
    argv = ["/ckpt", *argv]
    if config is not None:
        path = tmp_path / "options.yaml"
        path.write_text(yaml.safe_dump(config))
        argv += ["--config", str(path)]
    return llm_kwargs(parser().parse_args(argv))


def test_no_flags_give_no_kwargs():
    assert kwargs_for() == {}


def test_flags_map_to_llm_kwargs():
    kwargs = kwargs_for(
        "--tokenizer", "/tok", "--dtype", "float32", "--max_batch_size", "4", "--max_num_tokens", "256",
        "--max_seq_len", "640", "--allowed_local_media_path", "/media", "--allow_remote_media",
        "--max_media_pixels", "1000", "--disable_vision_encoder", "--enable_chunked_prefill",
        "--preprocess_workers", "2", "--kv_cache_free_gpu_memory_fraction", "0.5",
        # server-only flags, which are not LLM arguments
        "--host", "0.0.0.0", "--port", "1234", "--served_model_name", "m", "--trust_remote_code")
    assert kwargs == {
        "tokenizer": "/tok", "dtype": "float32", "max_batch_size": 4, "max_num_tokens": 256, "max_seq_len": 640,
        "allowed_local_media_path": "/media", "allow_remote_media": True, "max_media_pixels": 1000,
        "disable_vision_encoder": True, "enable_chunked_prefill": True, "preprocess_workers": 2,
        "kv_cache_config": {"free_gpu_memory_fraction": 0.5},
    }
    args = LlmArgs.from_kwargs(model="/ckpt", **kwargs)
    assert args.max_seq_len == 640 and args.allow_remote_media is True
    assert args.kv_cache_config == KvCacheConfig(free_gpu_memory_fraction=0.5)


def test_yaml_overrides_flags(tmp_path):
    kwargs = kwargs_for("--max_batch_size", "4", "--dtype", "float32",
                        config={"max_batch_size": 8, "max_media_bytes": 1024}, tmp_path=tmp_path)
    assert kwargs == {"max_batch_size": 8, "dtype": "float32", "max_media_bytes": 1024}


def test_yaml_kv_cache_config_merges_with_flag(tmp_path):
    kwargs = kwargs_for("--kv_cache_free_gpu_memory_fraction", "0.5",
                        config={"kv_cache_config": {"tokens_per_block": 16}}, tmp_path=tmp_path)
    assert kwargs["kv_cache_config"] == {"free_gpu_memory_fraction": 0.5, "tokens_per_block": 16}
    args = LlmArgs.from_kwargs(model="/ckpt", **kwargs)
    assert args.kv_cache_config == KvCacheConfig(tokens_per_block=16, free_gpu_memory_fraction=0.5)


def test_yaml_kv_fraction_beats_flag(tmp_path):
    kwargs = kwargs_for("--kv_cache_free_gpu_memory_fraction", "0.5",
                        config={"kv_cache_config": {"free_gpu_memory_fraction": 0.7}}, tmp_path=tmp_path)
    assert kwargs["kv_cache_config"] == {"free_gpu_memory_fraction": 0.7}


def test_empty_yaml_changes_nothing(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert llm_kwargs(parser().parse_args(["/ckpt", "--max_seq_len", "64", "--config", str(path)])) == \
        {"max_seq_len": 64}


def test_yaml_that_is_not_a_mapping_exits(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(SystemExit, match="expected a mapping"):
        llm_kwargs(parser().parse_args(["/ckpt", "--extra_llm_api_options", str(path)]))


def test_json_flags_parse():
    kwargs = kwargs_for("--limit_mm_per_prompt", '{"image": 2, "video": 1}',
                        "--media_io_kwargs", '{"video": {"num_frames": 8}}')
    assert kwargs == {"limit_mm_per_prompt": {"image": 2, "video": 1},
                      "media_io_kwargs": {"video": {"num_frames": 8}}}


@pytest.mark.parametrize("flag", ["--limit_mm_per_prompt", "--media_io_kwargs"])
@pytest.mark.parametrize("value, message", [("{image: 2}", "not valid JSON"), ("[1, 2]", "expected a JSON object")])
def test_bad_json_flag_exits(capsys, flag, value, message):
    with pytest.raises(SystemExit) as exit_info:
        parser().parse_args(["/ckpt", flag, value])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_tensor_parallel_exits():
    with pytest.raises(SystemExit, match="tensor parallelism"):
        kwargs_for("--tp_size", "2")


def test_unknown_yaml_key_is_rejected(tmp_path):
    kwargs = kwargs_for(config={"max_seq_len": 64, "bogus_option": 1}, tmp_path=tmp_path)
    with pytest.raises(ValueError, match="bogus_option"):
        LlmArgs.from_kwargs(model="/ckpt", **kwargs)


def test_unknown_nested_yaml_key_is_rejected(tmp_path):
    kwargs = kwargs_for(config={"kv_cache_config": {"bogus": 1}}, tmp_path=tmp_path)
    with pytest.raises(ValueError, match=r"unknown kv_cache_config keys: \['bogus'\]"):
        LlmArgs.from_kwargs(model="/ckpt", **kwargs)


def test_graph_configs_become_dataclasses(tmp_path):
    kwargs = kwargs_for(config={
        "cuda_graph_config": {"batch_sizes": [1, 2, 4], "enable_padding": True},
        "torch_compile_config": {"enable_piecewise_cuda_graph": True, "capture_num_tokens": [64, 128]},
    }, tmp_path=tmp_path)
    args = LlmArgs.from_kwargs(model="/ckpt", **kwargs)
    assert args.cuda_graph_config == CudaGraphConfig(batch_sizes=[1, 2, 4], max_batch_size=0, enable_padding=True)
    assert args.torch_compile_config == TorchCompileConfig(enable_piecewise_cuda_graph=True,
                                                           capture_num_tokens=[64, 128])


def test_unknown_graph_config_key_is_rejected(tmp_path):
    kwargs = kwargs_for(config={"cuda_graph_config": {"padding": True}}, tmp_path=tmp_path)
    with pytest.raises(ValueError, match="cuda_graph_config.*padding"):
        LlmArgs.from_kwargs(model="/ckpt", **kwargs)


# --- the real command ---

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_lines(stream, lines: queue.Queue) -> None:
    for line in stream:
        lines.put(line)


def wait_for_line(lines: queue.Queue, text: str, deadline: float) -> str:
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.2)
        except queue.Empty:
            continue
        if text in line:
            return line
    raise AssertionError(f"no line containing {text!r} before the deadline")


def test_serve_command_starts_and_answers(tmp_path):
    ckpt = tiny.make_tiny("qwen2_5_vl", tmp_path / "ckpt", seed=0)
    config = tmp_path / "serve.yaml"
    config.write_text(yaml.safe_dump({"max_seq_len": 640, "kv_cache_config": {"tokens_per_block": 16}}))
    port = free_port()
    stderr = open(tmp_path / "stderr.log", "w")
    process = subprocess.Popen(
        [sys.executable, "-m", "trtllm_qwenvl", "serve", str(ckpt), "--port", str(port), "--host", "127.0.0.1",
         "--served_model_name", "tiny-vl", "--config", str(config)],
        stdout=subprocess.PIPE, stderr=stderr, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        lines = queue.Queue()
        threading.Thread(target=read_lines, args=(process.stdout, lines), daemon=True).start()
        deadline = time.monotonic() + 30
        startup = wait_for_line(lines, "listening on", deadline)
        assert "model tiny-vl" in startup
        assert "KV blocks x 16 tokens" in startup
        assert f"http://127.0.0.1:{port}" in startup

        while True:  # uvicorn binds the port a moment after the startup line
            try:
                models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2)
                break
            except httpx.TransportError:
                assert process.poll() is None, (tmp_path / "stderr.log").read_text()
                assert time.monotonic() < deadline, "the server did not start listening"
                time.sleep(0.1)
        assert models.status_code == 200
        [card] = models.json()["data"]
        assert card["id"] == "tiny-vl"
        assert card["max_model_len"] == 640
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        stderr.close()

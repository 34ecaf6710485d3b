from setuptools import find_packages, setup

setup(
    name="trtllm-qwenvl",
    version="0.1.0",
    description="TensorRT-LLM-style PyTorch model pack and compact runtime for Qwen vision-language models",
    packages=find_packages(include=["trtllm_qwenvl", "trtllm_qwenvl.*"]),
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.11",
        "torchvision",
        "transformers>=5.17,<6",
        "safetensors",
        "numpy",
        "pillow",
        "av",
        "tqdm",
        "nvtx",
        "xxhash",
        "pyyaml",
        "jinja2",
    ],
    entry_points={"console_scripts": ["trtllm-qwenvl=trtllm_qwenvl.cli:main"]},
)

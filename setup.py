"""megatron-gspo: GSPO reinforcement learning for MoE models on Megatron-LM (a plugin)."""

from setuptools import find_packages, setup

setup(
    name="megatron-gspo",
    version="0.1.0",
    description="GSPO (Group Sequence Policy Optimization) for Mixture-of-Experts models on "
    "megatron-core, with SGLang rollouts",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.12",
    packages=find_packages(include=["megatron_gspo", "megatron_gspo.*"]),
    install_requires=[
        "torch>=2.6,<2.15",
        "megatron-core>=0.19.2,<0.20",
        # megatron-bridge's declared dependencies are GPU/experiment-tracking heavy; conversion
        # needs only these. Install it with `pip install --no-deps megatron-bridge==0.6.2`.
        "transformers>=5.8,<=5.12.1",
        "omegaconf",
        "einops",
        "rich",
        "safetensors",
        "pyyaml>=6",
        "numpy",
        "aiohttp>=3.9",
        "tqdm",
        "tensorboard",
        "math-verify>=0.7",
        "matplotlib",
    ],
    extras_require={
        # The SGLang client needs only sglang's Python modules (request types, serializer);
        # install sglang itself with --no-deps on trainer nodes (see constraints.txt).
        "sglang": ["sglang-router>=0.3", "msgspec", "pydantic>=2", "fastapi", "uvicorn"],
        "gpu": ["transformer-engine[pytorch]>=2.4", "apex"],
        "dev": ["pytest>=8", "pytest-timeout", "hypothesis>=6", "ruff>=0.6"],
    },
    # megatron_gspo/entry.py: each installs the one-line Ctrl-C handler before importing torch
    entry_points={
        "console_scripts": [
            "megatron-gspo-train=megatron_gspo.entry:train",
            "megatron-gspo-convert-to-hf=megatron_gspo.entry:convert_to_hf",
            "megatron-gspo-convert-from-hf=megatron_gspo.entry:convert_from_hf",
        ]
    },
)

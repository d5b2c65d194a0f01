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
        # Every model is built through megatron-bridge's provider (megatron/model.py). pip
        # resolves its declared dependencies too (heavy: mlflow, flashinfer, ...); the locked
        # environments (constraints.txt) install it with --no-deps and list what it needs.
        "megatron-bridge>=0.6.2,<0.7",
        "transformers>=5.8,<=5.12.1",
        "tokenizers",
        "omegaconf",
        "einops",
        "rich",
        "safetensors",
        "pyyaml>=6",
        "numpy",
        "aiohttp>=3.9",
        "pydantic>=2",
        "psutil",
        "tqdm",
        "tensorboard",
        "math-verify>=0.7",
        "matplotlib",
        # Parquet / Hugging Face prompts (data.format) and W&B logging (logging.wandb_project):
        # required, not extras, because megatron-bridge above already requires datasets (which
        # brings pyarrow) and wandb (==0.29.0), so extras would save nothing; declared here so
        # the features do not hang on the bridge's choices. Tested with pyarrow 26.0.1,
        # datasets 5.2.0 and wandb 0.31.0 (constraints.txt).
        "pyarrow>=14",
        "datasets>=2.20",
        "wandb>=0.29",
        # Agent rollouts (rollout.agent, megatron_gspo/agents/): the agent gets a real OpenAI
        # client on the job's token-exact endpoint (constraints.txt: openai 2.8.0).
        "openai>=2.8",
    ],
    extras_require={
        # The SGLang client and the embedded engine's server need only sglang's Python modules
        # (request types, serializer, the FastAPI app); install sglang itself with --no-deps on
        # trainer nodes (its pins, torch 2.14.1 and transformers 5.19, conflict with
        # megatron-bridge's transformers<=5.12.1; see constraints.txt). The engines run a full
        # SGLang in their own venv (constraints-engine.txt).
        "sglang": [
            "sglang-router>=0.3",
            "msgspec",
            "fastapi",
            "starlette",
            "uvicorn",
        ],
        # Transformer Engine only: megatron-core tries TE first wherever apex is an option, and
        # nothing here imports apex (constraints-gpu.txt).
        "gpu": ["transformer-engine[pytorch]>=2.4"],
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

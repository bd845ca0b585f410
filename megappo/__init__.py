"""megappo: PPO post-training of LLMs on megatron-core, with vLLM rollout in a hybrid engine."""

__version__ = "0.1.0"

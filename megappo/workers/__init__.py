"""Worker-side code: the shared megatron engine (megatron_engine.py), Ray worker groups and the
actor / critic / rollout workers. Heavy imports stay inside the submodules."""

"""What runs inside a worker process: the role workers the driver calls (roles.py; the rollout half of the actor's
worker: rollout_role.py; the batch plumbing they share: role_batches.py), the shared
megatron engine (megatron_engine.py: setup and API; engine_config.py: what it is asked to be, from the run's
config; engine_checkpoint.py: its checkpoints; megatron_step.py: one pass over a batch),
sequence packing, host offload, and the vLLM rollout / hybrid engine / weight sync (rollout/).
Worker groups and dispatch live in megappo.controller. Heavy imports stay inside the submodules."""

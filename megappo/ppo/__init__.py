"""The PPO algorithm, on the driver: core_algos (pure torch math: advantages, KL), losses (the
per-token losses and the actor's and critic's loss objects the workers apply), metrics, and the trainer (ray_trainer.RayPPOTrainer.fit: the loop)."""

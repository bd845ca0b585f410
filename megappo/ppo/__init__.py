"""The PPO algorithm, on the driver: core_algos (pure torch math), losses (the actor's and critic's
losses the workers apply), metrics, and the trainer (ray_trainer.RayPPOTrainer.fit: the loop)."""

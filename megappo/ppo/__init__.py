"""PPO algorithm pieces: core_algos (pure torch math); the trainer lives next to it."""

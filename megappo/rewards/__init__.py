"""Rewards picked by data_source (rules: gsm8k, math, arithmetic, config reward.rules; code against test cases;
reward.combine's weighted terms) and the RewardManager.
The manager (torch) is imported on first use: megappo.rewards.rules is read by the config loader."""

__all__ = ["DEFAULT_SCORERS", "RewardManager"]


def __getattr__(name: str):
    if name in __all__:
        from megappo.rewards import manager

        return getattr(manager, name)
    raise AttributeError(f"module 'megappo.rewards' has no attribute {name!r}")

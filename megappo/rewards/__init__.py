"""Rule-based rewards picked by data_source (gsm8k, math, arithmetic) and the RewardManager."""

from megappo.rewards.manager import DEFAULT_SCORERS, RewardManager

__all__ = ["DEFAULT_SCORERS", "RewardManager"]

"""SamplingSpec: how one generate call samples, made once on the driver and carried down in
`meta_info["sampling"]` of the prompts (and back in the rollout's output, seed included), so the
vLLM sampler, the replica seed offsets and the trainer's log-prob temperature read one value.

    spec = SamplingSpec.from_config(cfg.rollout)          # training: rollout.n samples at rollout.temperature
    prompts.meta_info["sampling"] = spec.with_seed(seed)   # a step's rollout: seeded from (trainer.seed, step)
    prompts.meta_info["sampling"] = spec.greedy()          # validation: one greedy response per prompt
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class SamplingSpec:
    n: int = 1  # responses per prompt (when sampling)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 = off
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()  # added to the tokenizer's eos
    do_sample: bool = True  # False: greedy, one response per prompt
    seed: Optional[int] = None  # base seed of the call: request k is sampled with seed + k

    @classmethod
    def from_config(cls, rollout) -> "SamplingSpec":
        return cls(n=int(rollout.n), temperature=float(rollout.temperature), top_p=float(rollout.top_p),
                   top_k=int(rollout.top_k), max_new_tokens=int(rollout.max_new_tokens),
                   stop_token_ids=tuple(int(t) for t in rollout.stop_token_ids))

    def greedy(self) -> "SamplingSpec":
        return dataclasses.replace(self, do_sample=False, seed=None)

    def with_seed(self, seed: Optional[int]) -> "SamplingSpec":
        return dataclasses.replace(self, seed=None if seed is None else int(seed))

    @property
    def num_samples(self) -> int:
        """Responses per prompt this call produces: n when sampling, 1 when greedy."""
        return self.n if self.do_sample else 1

    @property
    def logprob_temperature(self) -> float:
        """The temperature the responses' log-probs are taken at (vLLM's processed log-probs and the
        trainer's): the sampling temperature, or 1 for greedy decoding."""
        return self.temperature if self.do_sample else 1.0

    def vllm_kwargs(self) -> dict:
        """vllm.SamplingParams keywords, less n and seed (set per request)."""
        sampling = self.do_sample and self.temperature > 0
        return dict(temperature=self.temperature if sampling else 0.0,
                    top_p=self.top_p if sampling else 1.0,
                    top_k=self.top_k if sampling else -1,
                    max_tokens=self.max_new_tokens,
                    stop_token_ids=list(self.stop_token_ids))

"""A MegatronEngine's checkpoints: megatron dist_checkpointing (torch_dist) of its model (+ optimizer, LR
scheduler and step count; a LoRA engine's adapters only, with their metadata), written in the background or
not, loadable into any other layout of the same model. Mixed into MegatronEngine: it reads the engine's chunks,
optimizer, scheduler, LoRA config and `resident()`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch.distributed as dist

from megappo.models.lora import is_lora_param
from megappo.utils.checkpoint import LORA_META, lora_checkpoint_meta, lora_checkpoint_problem


class EngineCheckpoints:
    def _sharded_state_dict(self, is_loading: bool) -> dict:
        chunks = self.inner_chunks()
        model_sd = {}
        if len(chunks) == 1:
            model_sd["model"] = chunks[0].sharded_state_dict()
        else:
            for i, c in enumerate(chunks):
                model_sd[f"model{i}"] = c.sharded_state_dict()
        if self.lora is not None:  # the adapters only: the frozen base comes from model.path
            model_sd = {k: {n: t for n, t in v.items() if is_lora_param(n)} for k, v in model_sd.items()}
        sd = dict(model_sd)
        if self.optimizer is not None:
            from megappo.parallel import dist_checkpoint

            if not is_loading:
                dist_checkpoint.ensure_optimizer_state(self.optimizer)
            sd["optimizer"] = self.optimizer.sharded_state_dict(
                model_sd, is_loading=is_loading, metadata={"distrib_optim_sharding_type": "fully_reshardable",
                                               "distrib_optim_fully_reshardable_mem_efficient": True})
            sd["scheduler"] = self.scheduler.state_dict()
            sd["steps"] = self.steps
        return sd

    def save_checkpoint(self, path, background: bool = False) -> None:
        """megatron dist_checkpointing (torch_dist) of model (+ optimizer, scheduler): loadable into any
        other layout of the same model. Collective: every rank calls it. background=True returns once
        the tensors are copied; the files are written by a thread until `finish_save()` (collective)."""
        from megappo.parallel import dist_checkpoint

        self.finish_save()
        with self.resident():
            self._pending_save = dist_checkpoint.save(path, self._sharded_state_dict(is_loading=False), background)
        if self.lora is not None and dist.get_rank() == 0:  # after the save (which starts from an empty dir)
            (Path(path) / LORA_META).write_text(json.dumps(lora_checkpoint_meta(self.lora, self.model_path), indent=1))

    def _check_lora_checkpoint(self, path) -> None:
        """An adapter checkpoint for another base or adapter shape, or a full one for a LoRA engine (or the
        reverse), refused in one line before megatron's loader reports a shape mismatch (the driver's config
        check refuses a resume the same way before any worker starts)."""
        problem = lora_checkpoint_problem(path, self.lora, self.model_path)
        if problem:
            raise ValueError(problem)

    def finish_save(self) -> None:
        """Wait for a background save's files and write its metadata (a no-op when none is pending)."""
        pending, self._pending_save = self._pending_save, None
        if pending is not None:
            pending.finish()

    def load_checkpoint(self, path, load_optimizer: bool = True) -> None:
        from megappo.parallel import dist_checkpoint

        self.finish_save()
        self._check_lora_checkpoint(path)
        with self.resident():
            dist_checkpoint.load(path, self, load_optimizer=load_optimizer, strict=self.lora is None)

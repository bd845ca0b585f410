"""The batch plumbing every megatron role worker shares (workers/roles.py): a forward over this DP rank's rows
(`_forward`, padded to the micro-batch size), the update loop (`_train`: `ppo_epochs` passes of mini-batches,
one optimizer step each, the metrics averaged, the tokens and peak memory counted) and the DP all-reduces
both use, plus what a batch says of itself (its response length, the temperature it was sampled at).
"""

from __future__ import annotations

import functools
from collections import defaultdict
from typing import Optional

from megappo.models.routing_replay import ROUTES
from megappo.models.vision import IMAGE_KEYS
from megappo.protocol import DataProto

_MODEL_KEYS = ("input_ids", "attention_mask", "position_ids") + IMAGE_KEYS  # the images: a vision-language model's


def model_keys(data: DataProto) -> list:
    """What the model call reads of `data`: _MODEL_KEYS it has, and with images the response mask (an image pad the
    policy sampled is text; an agent's later images are not: models/vision.mrope_positions)."""
    keys = [k for k in _MODEL_KEYS if k in data.batch]
    return keys + (["response_mask"] if IMAGE_KEYS[1] in data.batch and "response_mask" in data.batch else [])


def _response_length(data: DataProto) -> int:
    if "responses" not in data.batch:
        raise KeyError("batch needs 'responses' [B, R] (the last R columns of input_ids) to know the response length")
    return int(data.batch["responses"].shape[1])


def _logprob_temperature(data: DataProto) -> float:
    """The temperature the rows were sampled at: their SamplingSpec travels in meta_info["sampling"]
    (set by the driver, kept by the rollout); rows without one are scored at temperature 1."""
    spec = data.meta_info.get("sampling")
    return 1.0 if spec is None else float(spec.logprob_temperature)


def _forward(engine, data: DataProto, response_length: int, micro_batch_size: int, frozen: bool = False,
             replay_routes: bool = False, **kw) -> Optional[dict]:
    """engine.forward_only over this rank's rows, padding them to a multiple of the micro-batch size. `frozen`: a
    frozen role in a process of its own (the teacher, a reward model, a reference outside the actor's), whose forward
    peak (a micro-batch's logits: R x b x V / tp, fp32 log-softmax beside them) would otherwise stay reserved in
    PyTorch's cache while vLLM wakes into the memory it sized at start: on GPU the cache is emptied after it.
    `replay_routes`: a MoE batch's `routed_experts` route the forward (models/routing_replay.py)."""
    n = len(data)
    mbs = max(1, min(int(micro_batch_size), n))
    keys = model_keys(data) + ([ROUTES] if replay_routes and ROUTES in data.batch else [])
    padded, _ = data.select(batch_keys=keys, non_tensor_keys=[], meta_info_keys=[]).pad_to_divisor(mbs)
    out = engine.forward_only(dict(padded.batch), response_length=response_length, micro_batch_size=mbs, **kw)
    out = None if out is None else {k: v[:n].cpu() for k, v in out.items()}  # the driver gets CPU tensors
    if frozen:
        release_cache()
    return out  # None: not the last pipeline stage (the group does not read this rank)


def release_cache() -> None:
    """The device's cached, unused memory back to the device (a no-op on CPU)."""
    from megappo.parallel.device import on_gpu

    if on_gpu():
        import torch

        torch.cuda.empty_cache()


def _dp_all_reduce(values: list[float], op: str = "SUM") -> list[float]:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device="cpu")  # over gloo
    if mpu.get_data_parallel_world_size() > 1:
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op), group=mpu.get_data_parallel_group())
    return t.tolist()


def _peak_memory_gb() -> list[float]:
    """This process's peak resident memory (the hybrid engine's vLLM included) and its device's peak allocated
    memory (0 without a GPU), in GB, since the process started."""
    import resource

    import torch

    device = torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() else 0.0
    return [resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9, device]  # ru_maxrss: KiB on Linux


def _mini_batches(data: DataProto, mini_batch_size: int, dp: int, what: str) -> list[DataProto]:
    if mini_batch_size % dp:
        raise ValueError(f"{what}.ppo_mini_batch_size={mini_batch_size} is not a multiple of dp={dp}")
    local = mini_batch_size // dp
    if len(data) % local:
        raise ValueError(f"{what}: {len(data)} rows per dp rank is not a multiple of the per-rank mini-batch "
                         f"{local} (= ppo_mini_batch_size {mini_batch_size} / dp {dp})")
    return data.split(local)


def _train(engine, data: DataProto, loss, role_cfg, dp: int, temperature: float = 1.0) -> dict:
    """`role_cfg.ppo_epochs` passes over this DP rank's rows in mini-batches, one optimizer step each.
    `loss` (megappo.ppo.losses) says which batch keys it needs, its normaliser and its value; this
    function is the plumbing every loss shares. Returns the metrics averaged over the steps."""
    missing = [k for k in loss.required_keys if k not in data.batch]
    if missing:
        raise KeyError(f"{loss.name} update: batch lacks {missing}")
    keys = list(dict.fromkeys(model_keys(data) + list(loss.required_keys) +
                              [k for k in loss.optional_keys if k in data.batch]))
    replay = getattr(role_cfg, "router_replay", "off")
    if replay != "off":  # the update routes every token as the batch's routes say
        if ROUTES not in data.batch:
            raise KeyError(f"actor.router_replay={replay}: the batch has no '{ROUTES}' (the pi_old forward records "
                           "them under r2; a batch from before router_replay was set has none): set "
                           "actor.router_replay=off for it")
        keys.append(ROUTES)
    r = _response_length(data)
    history = defaultdict(list)
    tokens = [0.0, 0.0, 0.0]  # real, computed (after right_align), in the padded batch
    empty = 0  # mini-batches with no trained token on any DP rank (every row's agent failed): no step
    # mini_batch_rows: a batch with rows of rewritten histories (ppo/segments.py), filled to equal mini-batches
    mini_batch_size = data.meta_info.get("mini_batch_rows", role_cfg.ppo_mini_batch_size)
    minis = _mini_batches(data.select(batch_keys=keys), mini_batch_size, dp, loss.name)
    with engine.resident():  # offload=true: one reload / offload for the whole update
        for mini in minis * role_cfg.ppo_epochs:
            mask = mini.batch["response_mask"]
            norm, n_tokens = _dp_all_reduce([loss.normalizer(mask), float(mask.sum())])
            if n_tokens == 0:  # all ranks agree (all-reduced): nothing to learn from, and Adam would still move
                empty += 1
                continue
            first = not history  # no optimizer step yet (an empty mini-batch takes none): the weights as given
            step = engine.train_step(dict(mini.batch), functools.partial(loss, norm=norm, n_tokens=n_tokens, first=first),
                                     normalizer=norm, response_length=r,
                                     micro_batch_size=min(role_cfg.micro_batch_size, len(mini)),
                                     temperature=temperature, compute_entropy=loss.needs_entropy)
            tokens[1] += step.pop("computed_tokens")
            for k, v in step.items():
                history[k if "/" in k else f"{loss.name}/{k}"].append(float(v))
            ids = mini.batch["input_ids"]
            tokens[0] += float(mini.batch["attention_mask"].sum())
            tokens[2] += float(ids.numel())
    metrics = {k: sum(v) / len(v) for k, v in history.items()}
    metrics[f"{loss.name}/empty_minibatches"] = float(empty)
    # the waste padding would cost, made visible; and the rows trained on (all DP ranks, one pass)
    real, computed, padded, rows = _dp_all_reduce(tokens + [len(data)])
    metrics.update({f"tokens/{loss.name}_real": real, f"tokens/{loss.name}_computed": computed,
                    f"tokens/{loss.name}_padded_batch": padded, f"{loss.name}/rows": rows})
    rss, device = _dp_all_reduce(_peak_memory_gb(), op="MAX")  # the largest DP rank's
    metrics[f"perf/{loss.name}_peak_rss_gb"] = rss
    if device:
        metrics[f"perf/{loss.name}_peak_device_memory_gb"] = device
    return metrics

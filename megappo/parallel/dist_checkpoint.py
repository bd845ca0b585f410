"""megatron dist_checkpointing (torch_dist format) of model chunks + DistributedOptimizer state,
loadable into any other TP/PP/VPP/DP layout of the same model ("fully_reshardable" optimizer format).

Works on anything exposing `inner_chunks()`, `optimizer`, `scheduler` and `_sharded_state_dict(is_loading)`
(workers/megatron_engine.py's MegatronEngine). Every rank calls save/load (collective).

Three DistributedOptimizer load bugs of megatron-core 0.16.1 with the torch AdamW fallback (no
apex / TE FusedAdam; see docs/ENVIRONMENT.md) are handled in `load`; all three are still in 0.19.2, the
pinned release (distrib_optimizer.py:838, :1222, :1028 there; the line numbers below are 0.16.1's):
1. distrib_optimizer.py:642 `state_dict()` asserts one `step` over an EMPTY state (before the first
   step): we allocate the Adam state (zeros, one `step` tensor per param) first.
2. distrib_optimizer.py:940 `KeyError: 'step'`: the per-param copy iterates the live state keys
   (incl. `step`) over the checkpoint tensors (no `step`): we copy every key but `step`.
3. distrib_optimizer.py:825 gives ONE shared `step` tensor to every param; torch Adam increments it
   in place once per param per step, silently breaking bias correction after resume: we give each
   param its own copy.
On GPU megatron builds TE's (or apex's) FusedAdam instead, which keeps one integer `step` per param
GROUP and none per param; megatron handles that layout itself (the three fixes stay off), but a
checkpoint written with torch Adam (a CPU run) stores the group step as a float, which TE's C++
`multi_tensor_adam` (`const int step`) rejects: `_integer_group_steps` casts it back.
"""

from __future__ import annotations

import inspect
import queue
import shutil
import threading
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from megappo.parallel import device


def _distributed_optimizers(optimizer) -> list:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    opts = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return [o for o in opts if isinstance(o, DistributedOptimizer)]


def _uses_torch_adam(opt) -> bool:
    return isinstance(opt.optimizer, (torch.optim.Adam, torch.optim.AdamW)) and \
        not opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8


@torch.no_grad()
def _ensure_adam_state(opt) -> None:
    """Bug 1: allocate Adam state (own `step` per param) if the optimizer never stepped."""
    inner = opt.optimizer
    for group in inner.param_groups:
        for p in group["params"]:
            st = inner.state[p]
            if not st:
                st["step"] = torch.zeros((), dtype=torch.float32)
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def _patch_set_states(opt) -> None:
    """Bug 2: copy param + optimizer tensors except `step` (not stored per param in the checkpoint)."""
    if getattr(opt, "_megappo_set_states_patched", False):
        return
    orig = opt._set_main_param_and_optimizer_states

    @torch.no_grad()
    def _set_main_param_and_optimizer_states(model_param, tensors):
        if "step" in tensors:
            return orig(model_param, tensors)
        group_index, group_order = opt.model_param_group_index_map[model_param]
        main_param = opt.optimizer.param_groups[group_index]["params"][group_order]
        state = opt.optimizer.state[main_param]
        main_param.copy_(tensors["param"])
        for k, v in state.items():
            if k != "step":
                v.copy_(tensors[k])

    opt._set_main_param_and_optimizer_states = _set_main_param_and_optimizer_states
    opt._megappo_set_states_patched = True


def _unshare_steps(opt) -> None:
    """Bug 3: one `step` tensor per param."""
    for st in opt.optimizer.state.values():
        if "step" in st and torch.is_tensor(st["step"]):
            st["step"] = st["step"].detach().clone()


def _integer_group_steps(opt) -> None:
    """FusedAdam (TE / apex): the per-group `step` as an int, whichever optimizer wrote the checkpoint."""
    for group in opt.optimizer.param_groups:
        if "step" in group and not isinstance(group["step"], int):
            group["step"] = int(group["step"])


def ensure_optimizer_state(optimizer) -> None:
    """Bug 1 on save too: a checkpoint written before the first optimizer step (e.g. on preemption)."""
    for o in _distributed_optimizers(optimizer) if optimizer is not None else []:
        if _uses_torch_adam(o):
            _ensure_adam_state(o)


def save(path, sharded_state_dict: dict, background: bool = False) -> "Optional[BackgroundSave]":
    """Write `sharded_state_dict` to `path` (collective: every rank calls it).

    background=True returns once the collectives (the save plan) are done and this rank's tensors
    are copied (a clone on CPU, a device-to-host copy on GPU): a thread writes the files while
    training goes on, and `BackgroundSave.finish()` (collective again) joins it and writes the
    metadata. Until then the directory is incomplete. A blocking save is the same, finished at once.
    megatron's own writer (sync or async) forks the whole worker process per save, and hands the
    results back through a multiprocessing Manager (a spawned server process): in a vLLM + megatron
    worker that is seconds and a doubled memory map per save. The thread needs neither."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    path = Path(path)
    if dist.get_rank() == 0:
        if path.exists():
            shutil.rmtree(path)
        path.mkdir(parents=True)
    dist.barrier()
    if not isinstance(filesystem_async._results_queue, queue.Queue):
        filesystem_async._results_queue = queue.Queue()  # where _get_write_results_queue() looks first
    live = _storages(sharded_state_dict)  # before save: it replaces factories by what they build
    # megatron-core >= 0.19 defaults async_strategy="nvrx" (nvidia-resiliency-ext); the built-in writer
    # (FileSystemWriterAsync, whose write_preloaded_data BackgroundSave drives) is async_strategy="mcore"
    kw = {"async_strategy": "mcore"} if "async_strategy" in inspect.signature(dist_checkpointing.save).parameters \
        else {}
    pending = BackgroundSave(dist_checkpointing.save(sharded_state_dict, str(path), async_sharded_save=True, **kw),
                             live)
    if background:
        return pending
    pending.finish()
    return None


class BackgroundSave:
    """One rank's part of a save after its collectives: the write in a thread, the finalize pending."""

    def __init__(self, request, live: set):
        self.request = request
        self._error: Optional[BaseException] = None
        self._thread = None
        if request.async_fn is None:  # nothing to write on this rank (finalize still joins the others)
            return
        rank, buckets, results = request.async_fn_args
        # the writer's storage transforms, bound by FileSystemWriterAsync.get_save_function_and_args
        transforms = request.async_fn.args[0]
        buckets = _snapshot(buckets, request.preload_fn, live)
        self._thread = threading.Thread(target=self._write, args=(transforms, buckets, results),
                                        name=f"megappo-ckpt-writer-{rank}", daemon=True)
        self._thread.start()

    def _write(self, transforms, buckets, results_queue) -> None:
        """FileSystemWriterAsync.write_preloaded_data for each bucket, in this thread, one after another;
        the results go where megatron's finalize (retrieve_write_results) reads them."""
        from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

        out: dict | Exception = {}
        try:
            for i, bucket in enumerate(buckets):
                done, count = queue.Queue(), queue.Queue()
                count.put(i)
                FileSystemWriterAsync.write_preloaded_data(transforms, i, bucket, done, count, True)
                idx, res = done.get()
                if isinstance(res, Exception):
                    out = self._error = res
                    break
                out[idx] = res
        except BaseException as e:  # noqa: BLE001 - handed to finish(), which raises it on the main thread
            out = self._error = e
        results_queue.put(out)

    def finish(self) -> None:
        """Wait for the files, then megatron's finalize (global metadata on rank 0; collective: every
        rank runs it even after a failed write, and then raises; this rank's own write error first,
        e.g. the OSError of a full disk, not megatron's wrapped summary)."""
        if self._thread is not None:
            self._thread.join()
        try:
            for fn in self.request.finalize_fns:
                fn()
        except Exception as e:  # noqa: BLE001
            raise (self._error or e) from e
        if self._error is not None:
            raise self._error
        dist.barrier()


def _storages(sharded_state_dict: dict) -> set:
    """The storages the state dict's tensors live in (a model's params, an optimizer's states)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    return {v.data.untyped_storage().data_ptr() for v in nested_values(sharded_state_dict)
            if isinstance(getattr(v, "data", None), torch.Tensor)}


def _snapshot(buckets: list, preload_fn, live: set) -> list:
    """The tensors to write, frozen now: training changes the live ones in place while the thread
    writes. On GPU megatron's preload copies every tensor to the host; on CPU it clones only views,
    so any tensor still sharing a live storage is cloned here (one copy at most, never two)."""
    if device.on_gpu() and preload_fn is not None:
        return preload_fn()

    def frozen(t: torch.Tensor) -> torch.Tensor:
        return t.detach().clone() if t.untyped_storage().data_ptr() in live else t

    return [(file, key, (bytes_data, [(item, frozen(t)) for item, t in tensors]))
            for file, key, (bytes_data, tensors) in buckets]


def load(path, engine, load_optimizer: bool = True, strict: bool = True) -> None:
    """strict=False: the checkpoint holds part of the model only (a LoRA engine's adapters; the rest is
    already loaded from the HF base)."""
    import megatron.core
    from megatron.core import dist_checkpointing

    from megappo.utils.checkpoint import megatron_format_problem

    problem = megatron_format_problem(path, megatron.core.__version__)
    if problem:
        raise ValueError(problem)

    opt = engine.optimizer if load_optimizer else None
    dopts = _distributed_optimizers(opt) if opt is not None else []
    for o in dopts:
        if _uses_torch_adam(o):
            _ensure_adam_state(o)
            _patch_set_states(o)
    sd = engine._sharded_state_dict(is_loading=True)
    if opt is None:
        sd = {k: v for k, v in sd.items() if k.startswith("model")}
    loaded = dist_checkpointing.load(sd, str(path))
    chunks = engine.inner_chunks()
    if len(chunks) == 1:
        chunks[0].load_state_dict(loaded.get("model", loaded.get("model0")), strict=strict)
    else:
        for i, c in enumerate(chunks):
            c.load_state_dict(loaded[f"model{i}"], strict=strict)
    if opt is not None:
        opt.load_state_dict(loaded["optimizer"])
        for o in dopts:
            if _uses_torch_adam(o):
                _unshare_steps(o)
            else:
                _integer_group_steps(o)
        engine.scheduler.load_state_dict(loaded["scheduler"])
        engine.steps = int(loaded.get("steps", 0))
    else:
        # params changed under a DDP / optimizer that was not reloaded: nothing else to sync
        pass
    dist.barrier()

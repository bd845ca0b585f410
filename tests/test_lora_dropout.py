"""actor.lora.dropout under tensor parallelism (models/lora.py), fp32, CPU/gloo, megatron's engine.

A column-parallel linear's A (linear_qkv, linear_fc1, a routed expert's fc1) is replicated over the TP ranks, and
each rank computes its gradient from its own dropout mask of the same input: the masks must agree or the copies of
A drift apart (megatron does not all-reduce a replicated weight's gradient over TP). They did under sequence
parallelism (the tiny Mixtral at TP2: megatron runs the block inside the per-rank model-parallel generator), and
would wherever a rank's generator was not the other's: before each step the test draws extra numbers on one rank
from the default generator and from the data-parallel one (as after a resume at another TP, whose TP group holds
several replicas' states). Every replicated A stays bit-identical over two steps. A row-parallel linear's A sees its
rank's slice of the input: its mask is drawn per rank and per forward, not one pattern on every slice or at every
micro-batch (it was the same at every micro-batch under sequence parallelism on the CPU tracker, whose nested fork
of one name started over). And the masks are applied: the adapters differ from a step without dropout."""

import torch

from megappo.parallel.launch import spawn_local
from megappo.parallel.layout import ParallelLayout

RANK, ALPHA = 4, 8.0
OPTIM = dict(lr=1e-2, adam_eps=1e-4, clip_grad=1.0)


def _worker(rank, world, port, path, adapter, dropout, experts=False):
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel import get_cuda_rng_tracker
    from megatron.core.tensor_parallel.random import get_data_parallel_rng_tracker_name

    from megappo.models.gpt import load_hf_config
    from megappo.models.lora import LoraConfig, iter_lora_modules
    from megappo.models.lora_peft import load_hf_lora
    from megappo.parallel.megatron_init import init_distributed, init_megatron
    from megappo.parallel.weight_mapping import ModelDims
    from megappo.workers.megatron_engine import EngineConfig, MegatronEngine, OptimConfig
    from test_megatron_engine import R, make_batch, pg_loss

    init_distributed(rank, world, "127.0.0.1", port)
    layout = ParallelLayout(tp=2)
    init_megatron(layout)
    eng = MegatronEngine(path, layout, EngineConfig(optim=OptimConfig(**OPTIM),
                                                    lora=LoraConfig(rank=RANK, alpha=ALPHA, dropout=dropout,
                                                                    experts=experts)))
    tp_rank = mpu.get_tensor_model_parallel_rank()
    load_hf_lora(eng.inner_chunks(), adapter, ModelDims.from_hf_config(load_hf_config(path), tp=2), tp_rank, 2)
    mods = dict(iter_lora_modules(eng.inner_chunks()))
    row = mods[next(n for n in mods if n.endswith("linear_proj"))]  # a dense row-parallel linear
    row_masks, linear = [], torch.nn.functional.linear

    def spy(inp, w, *a):  # which of this rank's input features row's dropout kept, at each forward
        if w is row.lora_A:
            row_masks.append(inp.detach() != 0)
        return linear(inp, w, *a)

    batch = make_batch()
    torch.nn.functional.linear = spy
    try:
        for step in range(2):
            if tp_rank == 0:  # one rank draws from the default generator, and its data-parallel generator is
                torch.rand(17 + step)  # not the other's (as after a resume at another TP), the other's not
                with get_cuda_rng_tracker().fork(get_data_parallel_rng_tracker_name()):
                    torch.rand(5)
            eng.train_step(batch, pg_loss, batch["response_mask"].sum().item(), R, 4)  # 2 micro-batches
    finally:
        torch.nn.functional.linear = linear
    return {"tp": tp_rank, "row_masks": row_masks, "sequence_parallel": eng.tf_config.sequence_parallel,
            "A": {n: m.lora_A.detach().clone() for n, m in mods.items()},
            "B": {n: m.lora_B.detach().clone() for n, m in mods.items()}, "column": {
                n for n, m in mods.items() if m.lora_column}}


def _check_tp_pair(r0, r1):
    assert r0["column"] and r0["column"] == r1["column"]
    for n in r0["column"]:  # A replicated over TP at a column-parallel linear
        assert torch.equal(r0["A"][n], r1["A"][n]), n
    # a row-parallel linear's slices get their own masks (not one pattern repeated on every slice), and each
    # forward its own (under sequence parallelism they were the same at every micro-batch)
    assert len(r0["row_masks"]) == 4 and not torch.equal(r0["row_masks"][0], r1["row_masks"][0])
    assert not any(torch.equal(r0["row_masks"][0], m) for m in r0["row_masks"][1:])


def test_dropout_keeps_replicated_adapters_identical_over_tp(tiny_assets):
    from test_lora import random_adapter

    path = str(tiny_assets["tiny-llama"])
    adapter = random_adapter(path)
    r0, r1 = sorted(spawn_local(_worker, 2, path, adapter, 0.3, timeout=300), key=lambda r: r["tp"])
    _check_tp_pair(r0, r1)
    # the masks are applied: the same two steps without dropout end elsewhere
    no0, _ = sorted(spawn_local(_worker, 2, path, adapter, 0.0, timeout=300), key=lambda r: r["tp"])
    assert any(not torch.equal(r0["B"][n], no0["B"][n]) for n in r0["B"])


def test_dropout_on_expert_adapters_at_expert_tp2(tiny_assets):
    """Routed experts' adapters at TP2 (expert TP 2: the dispatcher gives both ranks the same tokens): each expert's
    replicated fc1 A stays identical, and its fc2 slices draw their masks from megatron's expert-parallel generator."""
    from test_lora_experts import random_adapter

    path = str(tiny_assets["tiny-mixtral"])
    r0, r1 = sorted(spawn_local(_worker, 2, path, random_adapter(path), 0.3, True, timeout=300),
                    key=lambda r: r["tp"])
    assert any(".experts." in n for n in r0["column"]) and r0["sequence_parallel"]
    _check_tp_pair(r0, r1)

"""ParallelLayout: megatron's rank order (tp fastest, then dp, then pp) and one-line validation errors.
(The order is also checked against parallel_state's real groups in test_megatron_parity.py.)"""

import pytest

from megappo.parallel.layout import ParallelLayout


def test_rank_order_tp_fastest_then_dp_then_pp():
    lay = ParallelLayout(tp=2, pp=2, dp=2)
    assert lay.world_size == 8
    assert [lay.coords(r) for r in range(8)] == [
        (0, 0, 0), (0, 0, 1), (1, 0, 0), (1, 0, 1), (0, 1, 0), (0, 1, 1), (1, 1, 0), (1, 1, 1)]
    for r in range(8):
        assert lay.rank(*lay.coords(r)) == r
    assert lay.tp_group(5) == [4, 5] and lay.dp_group(5) == [5, 7] and lay.pp_group(5) == [1, 5]
    assert [r for r in range(8) if lay.is_collect_rank(r)] == [4, 6]


def test_validate_rejects_bad_layouts_with_one_line_errors():
    lay = ParallelLayout(tp=2, pp=2, vpp=2)
    lay.validate(num_heads=4, num_kv_heads=2, num_layers=4)
    for kwargs, needle in [
        (dict(num_heads=4, num_kv_heads=1, num_layers=4), "num_key_value_heads"),
        (dict(num_heads=3, num_kv_heads=2, num_layers=4), "num_attention_heads"),
        (dict(num_heads=4, num_kv_heads=2, num_layers=6), "num_layers"),
        (dict(num_heads=4, num_kv_heads=2, num_layers=4, world_size=8), "world size"),
    ]:
        with pytest.raises(ValueError, match=needle) as e:
            lay.validate(**kwargs)
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="vpp"):
        ParallelLayout(pp=1, vpp=2)
    with pytest.raises(ValueError):
        ParallelLayout(tp=0)
    assert ParallelLayout(pp=2, vpp=1).virtual_pp is None and ParallelLayout(pp=2, vpp=2).virtual_pp == 2


def test_context_parallel_sits_between_tp_and_dp():
    lay = ParallelLayout(tp=2, cp=2, dp=2)
    assert lay.world_size == 8 and str(lay) == "TP2xCP2xPP1xDP2"
    assert [(lay.coords(r), lay.cp_rank(r)) for r in range(4)] == [
        ((0, 0, 0), 0), ((0, 0, 1), 0), ((0, 0, 0), 1), ((0, 0, 1), 1)]
    for r in range(8):
        assert lay.rank(*lay.coords(r), lay.cp_rank(r)) == r
    assert lay.cp_group(5) == [5, 7] and lay.tp_group(5) == [4, 5] and lay.dp_group(5) == [1, 5]
    assert [r for r in range(8) if lay.is_collect_rank(r)] == [0, 4]
    with pytest.raises(ValueError, match=r"tp\*cp\*pp\*dp = 2\*2\*1\*2 = 8 but the pool has 12 workers.*change dp to 3"):
        lay.validate(num_heads=4, num_kv_heads=2, num_layers=4, world_size=12)
    with pytest.raises(ValueError, match="cp=0"):
        ParallelLayout(cp=0)


def _groups_job(rank, world, port, layouts):
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from megappo.parallel.megatron_init import init_distributed, init_megatron

    init_distributed(rank, world, master_port=port)
    out = []
    for kw in layouts:
        init_megatron(ParallelLayout(**kw))
        out.append({name: dist.get_process_group_ranks(getattr(mpu, f"get_{name}_group")())
                    for name in ("tensor_model_parallel", "context_parallel", "data_parallel",
                                 "pipeline_model_parallel")})
    return out


def test_layout_groups_are_megatrons_with_context_parallel():
    """parallel_state's real groups (4 gloo ranks) against the layout's, at TP2xCP2 and CP2xDP2."""
    from megappo.parallel.launch import spawn_local

    layouts = [dict(tp=2, cp=2), dict(cp=2, dp=2)]
    reports = spawn_local(_groups_job, 4, layouts, timeout=180, threads=1)
    for i, kw in enumerate(layouts):
        lay = ParallelLayout(**kw)
        for rank, rep in enumerate(reports):
            got = rep[i]
            assert got["tensor_model_parallel"] == lay.tp_group(rank)
            assert got["context_parallel"] == lay.cp_group(rank)
            assert got["data_parallel"] == lay.dp_group(rank)
            assert got["pipeline_model_parallel"] == lay.pp_group(rank)

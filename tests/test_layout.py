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

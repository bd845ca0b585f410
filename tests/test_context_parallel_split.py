"""Context parallelism's zigzag split (megappo/parallel/context_parallel.py), checked alone: every real token on
exactly one rank, each rank holding chunks r and 2cp-1-r of every row, and attention computed rank by rank
(queries of the rank against keys / values gathered over the group in rank order, under the split's mask) equal
to the whole packed micro-batch's attention (models/packed_attention.py) within fp32 rounding."""

import pytest
import torch
import torch.nn.functional as F

from megappo.models.packed_attention import PackedLayout
from megappo.parallel.context_parallel import local_width, zigzag_split


def packed_segments(lengths, tail=0):
    seg = torch.cat([torch.full((n,), k, dtype=torch.long) for k, n in enumerate(lengths)])
    return torch.cat([seg, torch.full((tail,), -1, dtype=torch.long)])


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_every_token_once_and_rows_cut_zigzag(cp):
    lengths = [1, 7, 16, 5, 2]
    seg = packed_segments(lengths, tail=3)
    split = zigzag_split(seg, cp, multiple=2)
    assert split.local_tokens % 2 == 0
    real = split.source[split.source >= 0]
    assert sorted(real.tolist()) == list(range(sum(lengths)))  # each real column on exactly one rank
    start = 0
    for k, n in enumerate(lengths):
        c = -(-n // (2 * cp))
        for r in range(cp):
            held = split.place[r][split.row[r] == k].tolist()
            want = [p for chunk in (r, 2 * cp - 1 - r) for p in range(chunk * c, (chunk + 1) * c) if p < n]
            assert held == want
            # a token's slot holds its own packed column
            cols = split.source[r][split.row[r] == k]
            assert cols.tolist() == [start + p for p in want]
        start += n


@pytest.mark.parametrize("cp", [2, 3])
@pytest.mark.parametrize("lengths", [[9], [1, 13, 4, 6], [3, 3, 3]])
def test_attention_rank_by_rank_equals_the_whole_micro_batch(cp, lengths):
    torch.manual_seed(0)
    seg = packed_segments(lengths, tail=2)
    t, heads, groups, dim = seg.numel(), 4, 2, 8
    q = torch.randn(t, heads, dim)
    k, v = torch.randn(t, groups, dim), torch.randn(t, groups, dim)
    scale = dim ** -0.5
    want = PackedLayout(seg).attend(q, k, v, scale)

    split = zigzag_split(seg, cp)
    keys = torch.cat([split.take(k, r) for r in range(cp)])  # the all-gather, in rank order
    values = torch.cat([split.take(v, r) for r in range(cp)])
    got = torch.zeros_like(want)
    for r in range(cp):
        ql = split.take(q, r)
        out = F.scaled_dot_product_attention(ql.transpose(0, 1)[None], keys.transpose(0, 1)[None],
                                             values.transpose(0, 1)[None], attn_mask=split.mask(r), scale=scale,
                                             enable_gqa=True)[0].transpose(0, 1)
        assert torch.isfinite(out).all()  # padding queries see themselves: no empty softmax row
        real = split.source[r] >= 0
        got[split.source[r][real]] = out[real]
    real = seg >= 0
    torch.testing.assert_close(got[real], want[real], rtol=0, atol=1e-6)


def test_owner_maps_output_columns_to_rank_and_slot():
    seg = packed_segments([5, 8])
    split = zigzag_split(seg, 2)
    cols = torch.tensor([0, 4, 5, 12])
    rank, slot = split.owner(cols)
    for c, r, s in zip(cols.tolist(), rank.tolist(), slot.tolist()):
        assert int(split.source[r, s]) == c
    with pytest.raises(ValueError, match="padding"):
        split.owner(torch.tensor([13]))


def test_one_width_for_every_micro_batch():
    segs = [packed_segments([5, 8]), packed_segments([20], tail=4)]
    w = local_width(segs, cp=2, multiple=4)
    assert w % 4 == 0 and all(zigzag_split(s, 2, width=w).local_tokens == w for s in segs)
    with pytest.raises(ValueError, match="multiple of 4"):
        zigzag_split(segs[0], 2, multiple=4, width=10)


def _cp_job(rank, world, port, lengths, impl):
    import torch.distributed as dist

    from megappo.parallel.context_parallel import cp_attention, sum_over_cp

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)  # the same full tensors on every rank
    seg = packed_segments(lengths, tail=1)
    t = seg.numel()
    q, k, v = (torch.randn(t, h, 8, requires_grad=True) for h in (4, 2, 2))
    weight = torch.randn(t, 4, 8)  # a loss that weighs every output differently
    split = zigzag_split(seg, world)
    local = [split.take(x, rank).detach().requires_grad_() for x in (q, k, v)]
    out = cp_attention(*local, split.chunk_sizes(), 8 ** -0.5, dist.group.WORLD, impl)
    # this rank's outputs scattered to their packed columns, summed over the group: the whole micro-batch's
    real = split.source[rank] >= 0
    full = torch.zeros(t, 4, 8).index_put((split.source[rank][real],), out[real])
    full = sum_over_cp(full, dist.group.WORLD)
    loss = (full[seg >= 0] * weight[seg >= 0]).sum()
    loss.backward()
    grads = [torch.zeros(t, *x.shape[1:]).index_put((split.source[rank][real],), x.grad[real]) for x in local]
    dist.destroy_process_group()
    return {"full": full.detach(), "loss": float(loss), "grads": grads}


@pytest.mark.parametrize("impl", ["chunks", "mask"])
def test_cp_attention_and_its_gradients_over_gloo_equal_one_process(impl):
    """Two gloo ranks: the forward, the loss and q / k / v's gradients (each rank's share, put together) equal
    the whole micro-batch's in one process; the all-gather's backward sums every rank's use of its keys. Both
    attention paths: the CPU default (chunks) and the mask the chunk table gives (other devices)."""
    from megappo.parallel.launch import spawn_local

    lengths = [11, 4, 1]
    reports = spawn_local(_cp_job, 2, lengths, impl, timeout=120, threads=1)
    torch.manual_seed(0)
    seg = packed_segments(lengths, tail=1)
    t = seg.numel()
    q, k, v = (torch.randn(t, h, 8, requires_grad=True) for h in (4, 2, 2))
    weight = torch.randn(t, 4, 8)
    want = PackedLayout(seg).attend(q, k, v, 8 ** -0.5)
    loss = (want[seg >= 0] * weight[seg >= 0]).sum()
    loss.backward()
    real = seg >= 0
    for r in reports:
        assert abs(r["loss"] - float(loss)) <= 1e-5
        torch.testing.assert_close(r["full"][real], want.detach()[real], rtol=0, atol=1e-6)
    for i, x in enumerate((q, k, v)):
        got = reports[0]["grads"][i] + reports[1]["grads"][i]
        torch.testing.assert_close(got[real], x.grad[real], rtol=0, atol=1e-5)


@pytest.mark.parametrize("cp", [2, 3])
@pytest.mark.parametrize("lengths", [[9], [1, 13, 4, 6]])
@pytest.mark.parametrize("hv", [8, 5])  # multi-latent attention: values narrower than queries / keys
def test_chunked_attention_and_its_gradients_equal_the_masked_one(cp, lengths, hv):
    """The chunk path (flash on each chunk's prefix and its own chunk, merged by log-sum-exp; the backward from
    the merged statistics) equals the masked SDPA call on every rank: outputs and q / k / v gradients, one process
    standing in for the group (keys gathered by concatenation)."""
    from megappo.parallel.context_parallel import _chunked_attention, _masked_attention, table_mask

    torch.manual_seed(0)
    seg = packed_segments(lengths, tail=3)
    split = zigzag_split(seg, cp, multiple=2)
    t, heads, groups, dim = seg.numel(), 4, 2, 8
    base = [torch.randn(t, n, d) for n, d in ((heads, dim), (groups, dim), (groups, hv))]
    weight = torch.randn(split.local_tokens, heads, hv)
    table = split.chunk_sizes()
    assert table.tolist() == [[-(-n // (2 * cp)), n] for n in lengths]
    for r in range(cp):  # the mask the table gives is the split's
        assert torch.equal(table_mask(table, cp, r, split.local_tokens), split.mask(r))
    for r in range(cp):
        results = []
        for path in ("chunks", "mask"):
            q, k, v = (x.clone().requires_grad_() for x in base)
            ql = split.take(q, r)
            keys = torch.cat([split.take(k, s) for s in range(cp)])
            values = torch.cat([split.take(v, s) for s in range(cp)])
            if path == "chunks":
                out = _chunked_attention(ql, keys, values, table, dim ** -0.5, cp, r)
            else:
                out = _masked_attention(ql, keys, values, split.mask(r), dim ** -0.5)
            real = split.row[r] >= 0
            (out[real] * weight[real]).sum().backward()
            results.append((out.detach()[real], q.grad, k.grad, v.grad))
        for got, want in zip(*results):
            torch.testing.assert_close(got, want, rtol=0, atol=2e-6)

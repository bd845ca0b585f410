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

"""DataProto: every operation, with real values, and each error case."""

import pickle

import numpy as np
import pytest
import torch

from megappo.protocol import DataProto


def make(n: int = 4) -> DataProto:
    return DataProto.from_dict(
        tensors={
            "input_ids": torch.arange(n * 3, dtype=torch.long).reshape(n, 3),
            "values": torch.arange(n, dtype=torch.float32) / 10,
        },
        non_tensors={
            "prompt": [f"p{i}" for i in range(n)],
            "extra": [{"i": i, "tags": [i, i + 1]} for i in range(n)],
        },
        meta_info={"temperature": 1.0, "step": 3},
    )


def rows(d: DataProto) -> list[int]:
    """Row identities: the first input_ids column / 3 recovers the original row number."""
    return (d.batch["input_ids"][:, 0] // 3).tolist()


def assert_same(a: DataProto, b: DataProto) -> None:
    assert set(a.batch) == set(b.batch) and set(a.non_tensor_batch) == set(b.non_tensor_batch)
    for k in a.batch:
        assert a.batch[k].dtype == b.batch[k].dtype
        assert torch.equal(a.batch[k], b.batch[k]), k
    for k in a.non_tensor_batch:
        assert a.non_tensor_batch[k].dtype == b.non_tensor_batch[k].dtype
        assert a.non_tensor_batch[k].tolist() == b.non_tensor_batch[k].tolist(), k
    assert a.meta_info == b.meta_info


# ---------------------------------------------------------------- construction / validation
def test_from_dict_and_len():
    d = make(4)
    assert len(d) == 4
    assert d.non_tensor_batch["prompt"].dtype == object
    assert d.non_tensor_batch["prompt"].shape == (4,)
    assert d.non_tensor_batch["extra"][2] == {"i": 2, "tags": [2, 3]}
    assert len(DataProto()) == 0
    assert len(DataProto.from_dict(meta_info={"a": 1})) == 0


def test_list_of_lists_becomes_one_object_per_row():
    d = DataProto.from_dict(non_tensors={"x": [[1, 2], [3], [4, 5, 6]]})
    assert d.non_tensor_batch["x"].shape == (3,)
    assert d.non_tensor_batch["x"][2] == [4, 5, 6]


def test_length_mismatch_on_construction_names_key_and_sizes():
    with pytest.raises(ValueError) as e:
        DataProto.from_dict(tensors={"a": torch.zeros(4), "b": torch.zeros(3, 2)})
    msg = str(e.value)
    assert "'b'" in msg and "3" in msg and "4" in msg and "\n" not in msg
    with pytest.raises(ValueError, match=r"'s'.*2 rows.*'a' has 4"):
        DataProto.from_dict(tensors={"a": torch.zeros(4)}, non_tensors={"s": ["x", "y"]})


def test_bad_types_and_zero_dim():
    with pytest.raises(TypeError, match="torch.Tensor"):
        DataProto.from_dict(tensors={"a": np.zeros(3)})
    with pytest.raises(TypeError, match="numpy array"):
        DataProto.from_dict(non_tensors={"a": torch.zeros(3)})
    with pytest.raises(TypeError, match="numpy array"):
        DataProto.from_dict(non_tensors={"a": "abc"})
    with pytest.raises(ValueError, match="0-dim"):
        DataProto.from_dict(tensors={"a": torch.tensor(1.0)})
    with pytest.raises(ValueError, match="0-dim"):
        DataProto.from_dict(non_tensors={"a": np.array(1)})


def test_ops_validate_a_mutated_batch():
    d = make(4)
    d.batch["bad"] = torch.zeros(5)
    for op in (len, lambda x: x.chunk(2), lambda x: x.repeat(2), lambda x: x[0:2], lambda x: x.select()):
        with pytest.raises(ValueError, match=r"'bad'.*5 rows"):
            op(d)


def test_repr_shows_keys_and_shapes():
    r = repr(make(4))
    assert "len=4" in r and "input_ids: (4, 3) int64" in r and "prompt: (4,) object" in r
    assert "temperature" in r


# ---------------------------------------------------------------- indexing
def test_getitem_int_returns_len1_dataproto():
    d = make(4)
    row = d[2]
    assert isinstance(row, DataProto) and len(row) == 1
    assert rows(row) == [2]
    assert row.non_tensor_batch["prompt"].tolist() == ["p2"]
    assert row.meta_info == d.meta_info
    assert rows(d[-1]) == [3]
    assert rows(d[np.int64(1)]) == [1]
    with pytest.raises(IndexError):
        d[4]
    with pytest.raises(IndexError):
        d[-5]


def test_getitem_slice_and_indices():
    d = make(5)
    assert rows(d[1:4]) == [1, 2, 3]
    assert d[1:4].non_tensor_batch["prompt"].tolist() == ["p1", "p2", "p3"]
    assert rows(d[::-2]) == [4, 2, 0]
    assert rows(d[torch.tensor([4, 0, 0])]) == [4, 0, 0]
    assert rows(d[np.array([3, 1])]) == [3, 1]
    assert rows(d[[2, -1]]) == [2, 4]
    sub = d[[True, False, True, False, False]]
    assert rows(sub) == [0, 2] and sub.non_tensor_batch["prompt"].tolist() == ["p0", "p2"]
    assert rows(d[torch.tensor([False, True, False, False, True])]) == [1, 4]
    assert len(d[[]]) == 0 and d[[]].batch["input_ids"].shape == (0, 3)
    with pytest.raises(IndexError, match="mask"):
        d[[True, False]]
    with pytest.raises(IndexError, match="out of range"):
        d[[0, 5]]
    with pytest.raises(IndexError, match="integers or booleans"):
        d[np.array([0.5])]


def test_getitem_str_returns_column():
    d = make(3)
    assert torch.equal(d["values"], d.batch["values"])
    assert d["prompt"].tolist() == ["p0", "p1", "p2"]
    with pytest.raises(KeyError, match="nope"):
        d["nope"]


# ---------------------------------------------------------------- key ops
def test_select():
    d = make(4)
    s = d.select(batch_keys=["values"], non_tensor_keys="prompt", meta_info_keys=["step"])
    assert list(s.batch) == ["values"] and list(s.non_tensor_batch) == ["prompt"]
    assert s.meta_info == {"step": 3}
    assert torch.equal(s.batch["values"], d.batch["values"])
    everything = d.select()
    assert_same(everything, d)
    with pytest.raises(KeyError, match="missing"):
        d.select(batch_keys=["missing"])
    with pytest.raises(KeyError):
        d.select(meta_info_keys=["missing"])


def test_pop_removes_and_returns():
    d = make(4)
    p = d.pop(batch_keys=["values"], non_tensor_keys=["extra"], meta_info_keys=["step"])
    assert list(p.batch) == ["values"] and list(p.non_tensor_batch) == ["extra"] and p.meta_info == {"step": 3}
    assert torch.allclose(p.batch["values"], torch.tensor([0.0, 0.1, 0.2, 0.3]))
    assert list(d.batch) == ["input_ids"] and list(d.non_tensor_batch) == ["prompt"]
    assert d.meta_info == {"temperature": 1.0}
    assert len(d.pop()) == 0  # None pops nothing
    with pytest.raises(KeyError, match="nope"):
        d.pop(batch_keys=["input_ids", "nope"])
    assert "input_ids" in d.batch  # a failed pop changes nothing


def test_rename():
    d = make(2)
    r = d.rename(["input_ids", "prompt"], ["tokens", "text"])
    assert set(r.batch) == {"tokens", "values"} and set(r.non_tensor_batch) == {"text", "extra"}
    assert torch.equal(r.batch["tokens"], d.batch["input_ids"])
    assert "input_ids" in d.batch  # original untouched
    assert set(d.rename("values", "v").batch) == {"input_ids", "v"}
    with pytest.raises(KeyError, match="nope"):
        d.rename("nope", "x")
    with pytest.raises(ValueError, match="duplicate"):
        d.rename("values", "input_ids")
    with pytest.raises(ValueError, match="2 old keys but 1"):
        d.rename(["values", "prompt"], ["x"])


def test_union():
    d = make(4)
    a = d.select(batch_keys=["input_ids"], non_tensor_keys=["prompt"], meta_info_keys=["step"])
    b = d.select(batch_keys=["input_ids", "values"], non_tensor_keys=["extra", "prompt"], meta_info_keys=[])
    b.meta_info["temperature"] = 1.0
    u = a.union(b)
    assert_same(u, d)
    # equal NaNs count as equal
    n1 = DataProto.from_dict({"x": torch.tensor([float("nan"), 1.0])})
    n2 = DataProto.from_dict({"x": torch.tensor([float("nan"), 1.0]), "y": torch.zeros(2)})
    assert set(n1.union(n2).batch) == {"x", "y"}
    # a meta-only DataProto merges with anything
    assert len(d.union(DataProto.from_dict(meta_info={"new": 1}))) == 4


def test_union_errors():
    d = make(4)
    other = d.select()
    other.batch["values"] = other.batch["values"] + 1
    with pytest.raises(ValueError, match=r"batch\['values'\]"):
        d.union(other)
    other = d.select()
    other.non_tensor_batch["prompt"] = np.array(["x"] * 4, dtype=object)
    with pytest.raises(ValueError, match=r"non_tensor_batch\['prompt'\]"):
        d.union(other)
    other = d.select()
    other.meta_info["step"] = 4
    with pytest.raises(ValueError, match=r"meta_info\['step'\]"):
        d.union(other)
    other = d.select()
    other.batch["values"] = other.batch["values"].double()  # same numbers, other dtype
    with pytest.raises(ValueError, match="values"):
        d.union(other)
    with pytest.raises(ValueError, match=r"batch sizes differ \(4 vs 2\)"):
        d.union(make(2))


# ---------------------------------------------------------------- split / join
def test_chunk_and_concat_roundtrip():
    d = make(6)
    parts = d.chunk(3)
    assert [rows(p) for p in parts] == [[0, 1], [2, 3], [4, 5]]
    assert [p.non_tensor_batch["prompt"].tolist() for p in parts] == [["p0", "p1"], ["p2", "p3"], ["p4", "p5"]]
    assert all(p.meta_info == d.meta_info for p in parts)
    parts[0].meta_info["step"] = 99  # meta_info is copied per chunk
    assert d.meta_info["step"] == 3
    assert_same(DataProto.concat(d.chunk(3)), d)
    assert_same(DataProto.concat(d.chunk(1)), d)


def test_chunk_errors():
    d = make(5)
    with pytest.raises(ValueError, match=r"5 rows are not divisible into 2 chunks.*pad_to_divisor\(2\)"):
        d.chunk(2)
    with pytest.raises(ValueError, match="positive"):
        d.chunk(0)


def test_split():
    d = make(5)
    parts = d.split(2)
    assert [rows(p) for p in parts] == [[0, 1], [2, 3], [4]]
    assert_same(DataProto.concat(parts), d)
    assert [rows(p) for p in d.split(10)] == [[0, 1, 2, 3, 4]]
    with pytest.raises(ValueError, match="positive"):
        d.split(0)


def test_concat_meta_from_first_and_errors():
    a, b = make(2), make(3)
    b.meta_info = {"other": True}
    c = DataProto.concat([a, b])
    assert len(c) == 5 and rows(c) == [0, 1, 0, 1, 2] and c.meta_info == a.meta_info
    assert c.non_tensor_batch["prompt"].tolist() == ["p0", "p1", "p0", "p1", "p2"]
    with pytest.raises(ValueError, match="at least one"):
        DataProto.concat([])
    with pytest.raises(ValueError, match="item 1 has keys"):
        DataProto.concat([a, b.select(batch_keys=["values"])])
    wide = make(2)
    wide.batch["input_ids"] = torch.zeros(2, 7, dtype=torch.long)
    with pytest.raises(ValueError, match=r"input_ids.*\(2, 3\), \(2, 7\)"):
        DataProto.concat([a, wide])


def test_pad_to_divisor_and_unpad():
    d = make(5)
    padded, pad = d.pad_to_divisor(4)
    assert pad == 3 and len(padded) == 8
    assert rows(padded) == [0, 1, 2, 3, 4, 0, 1, 2]  # pad rows repeat the first rows
    assert padded.non_tensor_batch["prompt"].tolist()[5:] == ["p0", "p1", "p2"]
    assert len(padded.chunk(4)) == 4
    assert_same(padded.unpad(pad), d)
    # more padding than rows wraps around
    small, pad = make(2).pad_to_divisor(7)
    assert pad == 5 and rows(small) == [0, 1, 0, 1, 0, 1, 0]
    # already divisible: no padding
    same, pad = d.pad_to_divisor(5)
    assert pad == 0
    assert_same(same, d)
    assert_same(d.unpad(0), d)
    with pytest.raises(ValueError, match="divisor"):
        d.pad_to_divisor(0)
    with pytest.raises(ValueError, match="pad_size"):
        d.unpad(6)


def test_repeat():
    d = make(2)
    r = d.repeat(2, interleave=True)
    assert rows(r) == [0, 0, 1, 1]
    assert r.non_tensor_batch["prompt"].tolist() == ["p0", "p0", "p1", "p1"]
    assert r.batch["input_ids"].shape == (4, 3)
    t = d.repeat(3, interleave=False)
    assert rows(t) == [0, 1, 0, 1, 0, 1]
    assert t.non_tensor_batch["extra"][3] == {"i": 1, "tags": [1, 2]}
    assert t.meta_info == d.meta_info
    # 2-D numpy arrays keep their trailing dims
    m = DataProto.from_dict(non_tensors={"m": np.arange(4).reshape(2, 2)})
    assert m.repeat(2, interleave=False).non_tensor_batch["m"].tolist() == [[0, 1], [2, 3], [0, 1], [2, 3]]
    assert m.repeat(2).non_tensor_batch["m"].tolist() == [[0, 1], [0, 1], [2, 3], [2, 3]]
    with pytest.raises(ValueError, match="positive"):
        d.repeat(0)


def test_reorder():
    d = make(4)
    r = d.reorder(torch.tensor([2, 0, 3, 1]))
    assert rows(r) == [2, 0, 3, 1]
    assert r.non_tensor_batch["prompt"].tolist() == ["p2", "p0", "p3", "p1"]
    assert rows(d.reorder([3, 2, 1, 0])) == [3, 2, 1, 0]
    with pytest.raises(ValueError, match="permutation"):
        d.reorder([0, 0, 1, 2])
    with pytest.raises(ValueError, match="permutation"):
        d.reorder([0, 1])


def test_to_device():
    d = make(3)
    moved = d.to("cpu")
    assert_same(moved, d)
    assert moved.batch["values"].device.type == "cpu"
    if torch.cuda.is_available():
        g = d.to("cuda")
        assert g.batch["values"].is_cuda
        assert rows(g[torch.tensor([2, 0])].to("cpu")) == [2, 0]


def test_pickle_roundtrip():
    d = make(4)
    d.batch["mask"] = torch.tensor([True, False, True, True])
    d.batch["half"] = torch.randn(4, 2).to(torch.bfloat16)
    d.non_tensor_batch["num"] = np.arange(4, dtype=np.int32)
    d.meta_info["nested"] = {"a": [1, 2]}
    back = pickle.loads(pickle.dumps(d))
    assert_same(back, d)
    assert back.batch["half"].dtype == torch.bfloat16 and back.batch["mask"].dtype == torch.bool
    assert back.non_tensor_batch["num"].dtype == np.int32
    assert back.non_tensor_batch["extra"][1] == {"i": 1, "tags": [1, 2]}


def test_only_cpu_tensors_leave_a_process():
    """The DataProto boundary: a batch holding a device tensor refuses to be pickled (Ray, all_gather_object),
    naming the key, so a worker that forgets `.cpu()` fails at once instead of on the driver's missing GPU."""
    import pickle

    d = DataProto.from_dict({"ok": torch.zeros(2, 3), "logprobs": torch.zeros(2, 3, device="meta")})
    with pytest.raises(ValueError, match=r"device tensors: logprobs \(meta\).*move them to the CPU"):
        pickle.dumps(d)
    back = pickle.loads(pickle.dumps(d.select(batch_keys=["ok"])))
    assert torch.equal(back.batch["ok"], torch.zeros(2, 3))


def test_a_pickled_chunk_carries_its_own_rows_only():
    """A chunk is a view into the batch's tensors, and a pickled view carries its whole storage: through Ray
    each of N workers received all N chunks' rows. Pickling a chunk sends its rows only, and the same values."""
    import pickle

    dp = DataProto.from_dict({"input_ids": torch.arange(64 * 256).view(64, 256), "mask": torch.ones(64, 256)})
    whole = len(pickle.dumps(dp))
    parts = dp.chunk(8)
    sizes = [len(pickle.dumps(p)) for p in parts]
    assert max(sizes) < whole / 4, (sizes, whole)
    back = DataProto.concat([pickle.loads(pickle.dumps(p)) for p in parts])
    assert all(torch.equal(back.batch[k], dp.batch[k]) for k in dp.batch)

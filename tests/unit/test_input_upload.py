"""``rooflm.worker.input_batch.upload``: a step's int64 and int32 inputs in one host buffer and one copy, each read
back as a view of its own dtype at a 16-byte boundary, values unchanged (empty parts included)."""
import numpy as np
import pytest
import torch

from rooflm.worker.input_batch import upload


def test_parts_arrive_with_their_dtypes_values_and_alignment():
    parts = [np.arange(3, dtype=np.int64), np.array([], dtype=np.int64), np.array([-1, 2**40], dtype=np.int64),
             np.arange(5, dtype=np.int32) - 2, np.array([7], dtype=np.int32), np.arange(6, dtype=np.int64) * 3]
    out = upload(parts, torch.device("cpu"), pin=False)
    assert len(out) == len(parts)
    base = out[0].data_ptr()
    for a, t in zip(parts, out):
        assert t.dtype == (torch.int64 if a.dtype == np.int64 else torch.int32)
        assert t.tolist() == a.tolist()
        assert (t.data_ptr() - base) % 16 == 0 or t.numel() == 0
    assert out[3].untyped_storage().data_ptr() == out[0].untyped_storage().data_ptr()  # one buffer


def test_views_are_independent_where_written():
    a, b = upload([np.zeros(3, np.int64), np.ones(2, np.int32)], torch.device("cpu"), pin=False)
    a.index_copy_(0, torch.tensor([1]), torch.tensor([9]))
    assert a.tolist() == [0, 9, 0] and b.tolist() == [1, 1]


def test_a_part_other_than_a_vector_of_int64_or_int32_is_refused_by_name():
    with pytest.raises(ValueError, match="part 1 is float32"):
        upload([np.zeros(2, np.int64), np.zeros(2, np.float32)], torch.device("cpu"), pin=False)
    with pytest.raises(ValueError, match=r"part 0 is int32 of shape \(2, 2\)"):
        upload([np.zeros((2, 2), np.int32)], torch.device("cpu"), pin=False)

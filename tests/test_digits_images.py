import numpy as np
import pytest

from uniweave.data.digits_images import SPLITS, load_split, split_indices


def test_splits_are_disjoint_and_cover_the_dataset():
    parts = [set(split_indices(s).tolist()) for s in SPLITS]
    assert sum(len(p) for p in parts) == 1797
    assert len(set().union(*parts)) == 1797
    for i in range(3):
        for j in range(i + 1, 3):
            assert not parts[i] & parts[j]


def test_split_is_deterministic_and_scaled():
    a, b = load_split("test"), load_split("test")
    np.testing.assert_array_equal(a.indices, b.indices)
    assert a.images.dtype == np.float32 and a.images.shape[1:] == (8, 8)
    assert 0.0 <= a.images.min() and a.images.max() <= 1.0
    assert len(np.unique(a.labels)) == 10


def test_unknown_split_is_rejected():
    with pytest.raises(ValueError, match="unknown digits split 'dev'"):
        split_indices("dev")

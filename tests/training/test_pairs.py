"""Files of source<TAB>target pairs and their fixed train/validation split."""

import numpy as np
import pytest

from tformer.training.pairs import load_pairs, split_pairs


def test_pairs_file(tmp_path):
    path = tmp_path / "pairs.tsv"
    path.write_text("hello\tbonjour\n\ncat\tchat\r\n")
    assert load_pairs(path) == [("hello", "bonjour"), ("cat", "chat")]
    path.write_text("ok\tfine\nno tab here\n")
    with pytest.raises(ValueError, match=r"pairs\.tsv:2: expected 'source<TAB>target'"):
        load_pairs(path)
    with pytest.raises(FileNotFoundError, match=r"missing\.tsv does not exist; pass a file .*\(--pairs\)"):
        load_pairs(tmp_path / "missing.tsv")
    with pytest.raises(ValueError, match=r"pairs file .* is a directory; pass a file of source<TAB>target lines"):
        load_pairs(tmp_path)
    with pytest.raises(ValueError, match=r"pairs file /dev/null is not a regular file"):
        load_pairs("/dev/null")


def test_pairs_split_is_fixed_disjoint_and_complete():
    train, val = split_pairs(50, 0.2)
    assert len(val) == 10 and not set(train) & set(val) and sorted([*train, *val]) == list(range(50))
    np.testing.assert_array_equal(val, split_pairs(50, 0.2)[1])
    with pytest.raises(ValueError, match="at least 2 pairs"):
        split_pairs(1, 0.1)

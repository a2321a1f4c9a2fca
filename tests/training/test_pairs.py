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


def test_pairs_file_of_other_bytes_names_the_line_and_the_byte(tmp_path):
    path = tmp_path / "pairs.tsv"
    path.write_bytes(b"a\tb\r\nc\td\re\tf\n")  # \n, \r\n and a lone \r: each ends a line, as text mode reads them
    assert load_pairs(path) == [("a", "b"), ("c", "d"), ("e", "f")]
    path.write_bytes("caf\u00e9\tcoffee\n".encode() + b"the\ttea \xb4\n")  # latin-1 on line 2
    with pytest.raises(ValueError) as err:
        load_pairs(path)
    assert str(err.value) == (
        f"pairs file {path} is not UTF-8 text (line 2: byte 0xb4 at offset 21); pass a UTF-8 file of "
        "source<TAB>target lines (--pairs)"
    )


def test_pairs_split_is_fixed_disjoint_and_complete():
    train, val = split_pairs(50, 0.2)
    assert len(val) == 10 and not set(train) & set(val) and sorted([*train, *val]) == list(range(50))
    np.testing.assert_array_equal(val, split_pairs(50, 0.2)[1])
    with pytest.raises(ValueError, match="at least 2 pairs"):
        split_pairs(1, 0.1)


def test_a_byte_order_mark_at_the_start_is_not_part_of_the_first_source(tmp_path):
    path = tmp_path / "pairs.tsv"
    path.write_bytes("\ufeffhi\tsalut\nbye\tciao\n".encode())  # as Windows editors save UTF-8
    assert load_pairs(path) == [("hi", "salut"), ("bye", "ciao")]

"""Encoded rows kept compactly (numbers and category positions) give every batch exactly as the one-hot
encoding of the whole table does, and count the same fallbacks."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch

from parties.tables.encoding import MISSING_CATEGORY, MISSING_NUMBER, UNSEEN, EncodedRows, TabularEncoder, category_text
from parties.tables.schema import FeatureSchema


def _reference(encoder: TabularEncoder, frame: pd.DataFrame) -> tuple[np.ndarray, dict]:
    """The one-hot encoding written out value by value: text of every cell, looked up in the categories."""
    out = np.zeros((len(frame), encoder.width), dtype=np.float32)
    fallbacks: dict = {}
    for j, col in enumerate(encoder.schema.numeric):
        values = pd.to_numeric(frame[col], errors="coerce").to_numpy(dtype=np.float64)
        missing = np.isnan(values)
        if missing.any():
            fallbacks[col] = {MISSING_NUMBER: int(missing.sum())}
        out[:, j] = (np.where(missing, encoder.means_[col], values) - encoder.means_[col]) / encoder.scales_[col]
    at = len(encoder.schema.numeric)
    for col in encoder.schema.categorical:
        cats = encoder.categories_[col]
        text = category_text(frame[col]).to_numpy(dtype=object)
        for i, value in enumerate(text):
            if value in cats:
                out[i, at + cats.index(value)] = 1.0
        known = np.isin(text, cats)
        empty = int(((text == "") & ~known).sum())
        counts = {k: v for k, v in ((UNSEEN, int((~known).sum()) - empty), (MISSING_CATEGORY, empty)) if v}
        if counts:
            fallbacks[col] = counts
        at += len(cats)
    return out, fallbacks


def _frame(rng: np.random.Generator, n: int, unseen: bool) -> pd.DataFrame:
    words = np.array(["a", " b", "c ", "01", "1", "", "dd"] + (["zz", "new"] if unseen else []), dtype=object)
    text = pd.Series(rng.choice(words, n), dtype=object)
    text[rng.random(n) < 0.1] = None
    mixed = pd.Series(rng.choice(np.array([1, 2.0, "2", "x", None, np.nan], dtype=object), n), dtype=object)
    codes = pd.Series(rng.integers(0, 5 + 3 * unseen, n)).astype("float64")
    codes[rng.random(n) < 0.1] = np.nan
    numbers = pd.Series(rng.normal(size=n))
    numbers[rng.random(n) < 0.1] = np.nan
    return pd.DataFrame({"num": numbers, "big": rng.integers(0, 10**6, n), "text": text,
                         "cat": text.astype("category"), "mixed": mixed, "codes": codes,
                         "nullable": pd.array(rng.choice([1, 2, 3, None], n), dtype="Int64")})


@pytest.mark.parametrize("seed", range(5))
def test_every_batch_is_the_one_hot_of_its_rows_and_fallbacks_are_counted_alike(seed: int) -> None:
    rng = np.random.default_rng(seed)
    schema = FeatureSchema(("num", "big"), ("text", "cat", "mixed", "codes", "nullable"))
    encoder = TabularEncoder(schema).fit(_frame(rng, 400, unseen=False))
    frame = _frame(rng, 1000, unseen=True)
    expected, fallbacks = _reference(encoder, frame)
    assert set(fallbacks) >= {"num", "text", "codes"}  # the frame exercises the policies

    rows, counted = encoder.encode_rows(frame, chunk=97)  # several chunks, the last one short
    assert counted == fallbacks and rows.shape == expected.shape
    batch = torch.from_numpy(rng.permutation(len(frame))[:300])
    assert torch.equal(rows.take(batch), torch.from_numpy(expected)[batch])
    dense, again = encoder.encode(frame)
    assert np.array_equal(dense, expected) and again == fallbacks

    some = rng.permutation(len(frame))[:250]
    subset, _ = encoder.encode_rows(frame, some, chunk=64)
    assert torch.equal(subset.all(), torch.from_numpy(expected[some]))
    # Kept compactly: 4 bytes a number and 2 a categorical column, not 4 for every one-hot slot.
    assert subset.numbers.element_size() * subset.numbers.shape[1] + subset.codes.element_size() * 5 == 18
    assert encoder.width > 18 // 4


def test_already_encoded_rows_and_a_bad_shape() -> None:
    matrix = np.arange(12, dtype=np.float32).reshape(4, 3)
    rows = EncodedRows.dense(matrix)
    assert rows.shape == (4, 3) and torch.equal(rows.take(torch.tensor([2, 0])), torch.from_numpy(matrix[[2, 0]]))
    with pytest.raises(ValueError, match="codes of shape"):
        EncodedRows(matrix, np.zeros((3, 1), dtype=np.int16), [2])
    with pytest.raises(ValueError, match="categories"):
        EncodedRows(matrix, np.zeros((4, 1), dtype=np.int16), [0])


def test_a_trained_bottom_embeds_encoded_rows_batch_by_batch_as_all_at_once() -> None:
    from types import SimpleNamespace

    from parties.learning.trained_bottom import ScoringBottom

    rng = np.random.default_rng(3)
    schema = FeatureSchema(("num", "big"), ("text", "cat", "codes"))
    encoder = TabularEncoder(schema).fit(_frame(rng, 300, unseen=False))
    rows, _ = encoder.encode_rows(_frame(rng, 1000, unseen=True))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(encoder.width, 8), torch.nn.ReLU())
    bottom = SimpleNamespace(width=8, embed=lambda x: model(x).detach())
    whole = bottom.embed(rows.all())
    assert torch.allclose(ScoringBottom.embed_rows(bottom, rows, batch=97), whole, rtol=0, atol=1e-6)


def test_a_chunk_of_nothing_but_missing_values_encodes_as_missing() -> None:
    """A categorical column whose chunk (or chosen rows) holds only missing values has no distinct value there."""
    encoder = TabularEncoder(FeatureSchema((), ("job", "code"))).fit(
        pd.DataFrame({"job": ["a", "b"], "code": [1.0, 2.0]}))
    frame = pd.DataFrame({"job": ["a", "b", None, None], "code": [1.0, np.nan, np.nan, np.nan]})
    expected, fallbacks = _reference(encoder, frame)
    for rows, counted in (encoder.encode_rows(frame, chunk=2), encoder.encode_rows(frame, np.array([2, 3]))):
        assert torch.equal(rows.all(), torch.from_numpy(expected[-len(rows):]))
    assert encoder.encode_rows(frame, chunk=2)[1] == fallbacks == {"job": {MISSING_CATEGORY: 2},
                                                                   "code": {MISSING_CATEGORY: 3}}


def test_piecewise_linear_bins_are_fitted_on_training_rows_and_saved_with_the_encoder() -> None:
    """Quantile edges from the training rows; component t is 0 below bin t, 1 above, linear inside, the first
    bin open below and the last above; the saved encoder rebuilds the same rows."""
    train = pd.DataFrame({"x": [0.0, 0.0, 1.0, 1.0, 2.0, 2.0], "k": ["a", "b", "a", "b", "a", "b"]})
    encoder = TabularEncoder(FeatureSchema(("x",), ("k",)), bins=2).fit(train)
    assert encoder.edges_ == {"x": [0.0, 1.0, 2.0]}
    assert encoder.layout.numeric == (2,) and encoder.layout.categories == (2,) and encoder.width == 4
    assert encoder.feature_names() == ["x[bin 0]", "x[bin 1]", "k=a", "k=b"]
    new = pd.DataFrame({"x": [0.5, 1.5, -1.0, 3.0, None], "k": ["a", "b", "c", "a", "b"]})
    rows, fallbacks = encoder.encode_rows(new)
    expected = [[0.5, 0, 1, 0], [1, 0.5, 0, 1], [-1, 0, 0, 0], [1, 2, 1, 0]]
    mean = 1.0  # a missing number takes the training mean: inside bin 1, at its start
    expected.append([1, (mean - 1.0), 0, 1])
    assert torch.allclose(rows.all(), torch.tensor(expected, dtype=torch.float32), atol=1e-6)
    assert fallbacks == {"x": {MISSING_NUMBER: 1}, "k": {UNSEEN: 1}}
    saved = TabularEncoder.from_dict(json.loads(json.dumps(encoder.to_dict())))
    assert torch.equal(saved.encode_rows(new)[0].all(), rows.all())
    # Without bins the encoder and its file are as they always were: z-scores, no edges saved.
    plain = TabularEncoder(FeatureSchema(("x",), ("k",))).fit(train)
    assert "bins" not in plain.to_dict() and plain.layout.numeric == (1,)


def test_a_column_with_one_value_keeps_its_z_score_under_bins() -> None:
    train = pd.DataFrame({"same": [4.0] * 5, "x": [1.0, 2.0, 3.0, 4.0, 5.0]})
    encoder = TabularEncoder(FeatureSchema(("same", "x"), ()), bins=4).fit(train)
    assert encoder.layout.numeric == (1, 4)
    rows, _ = encoder.encode_rows(pd.DataFrame({"same": [4.0, 6.0], "x": [3.0, 3.0]}))
    assert rows.all()[:, 0].tolist() == [0.0, 2.0]  # (value - mean) / 1: a constant column has scale 1


@pytest.mark.parametrize(("change", "message"), [
    ({"bins": 10**6}, "whole number from 0 to 256"),
    ({"bins": 2.5}, "whole number from 0 to 256"),
    ({"edges": {"x": [0.0, float("nan"), 2.0]}}, "finite, increasing"),
    ({"edges": {"x": [2.0, 1.0, 0.0]}}, "finite, increasing"),
    ({"edges": {"x": [0.0, 1.0, 2.0, 3.0, 4.0]}}, "at most 3"),
    ({"edges": {"x": ["0", "1"]}}, "finite, increasing"),
    ({"edges": {}}, "do not name its numeric columns"),
    ({"bins": 0}, "do not name its numeric columns"),
])
def test_bin_edges_from_a_file_or_a_peer_are_checked(change: dict, message: str) -> None:
    """A horizontal configuration's branch reads the bank's encoder: its bins are checked like every field."""
    train = pd.DataFrame({"x": [0.0, 1.0, 2.0, 3.0], "k": ["a", "b", "a", "b"]})
    state = TabularEncoder(FeatureSchema(("x",), ("k",)), bins=2).fit(train).to_dict() | change
    with pytest.raises(ValueError, match=message):
        TabularEncoder.from_dict(json.loads(json.dumps(state)))

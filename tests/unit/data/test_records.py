"""Records of a data file: JSONL lines and datasets rows with their places, and the holdout split."""

from __future__ import annotations

import json
import sys
import types

import pytest

from openaligner.data.records import DataFileError, read_records, split_holdout


def test_jsonl_records_keep_their_line_and_any_json_values(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(
        json.dumps({"prompt": "p", "n": 3}) + "\n\n" + json.dumps({"messages": [{"a": 1}]}) + "\n"
    )
    first, second = read_records(path)
    assert first.fields == {"prompt": "p", "n": 3} and first.where == f"{path}:1"
    assert second.fields == {"messages": [{"a": 1}]} and second.where == f"{path}:3"
    assert str(second.error("bad")) == f"{path}:3: bad"


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ('{"prompt": "p"}\n{not json\n', r"d\.jsonl:2: not valid JSON"),
        ('{"prompt": "p"}\n["p"]\n', r"d\.jsonl:2: expected a JSON object, got list"),
        (" \n\n", r"d\.jsonl is empty"),
    ],
)
def test_jsonl_errors_name_the_file_and_line(tmp_path, text, problem):
    path = tmp_path / "d.jsonl"
    path.write_text(text)
    with pytest.raises(DataFileError, match=problem):
        read_records(path)


def test_missing_path_and_plain_directory_are_refused(tmp_path, monkeypatch):
    with pytest.raises(DataFileError, match="does not exist"):
        read_records(tmp_path / "missing.jsonl")
    monkeypatch.setitem(sys.modules, "datasets", None)  # not installed
    with pytest.raises(DataFileError, match=r"is a directory; .*pip install datasets"):
        read_records(tmp_path)


class _FakeDataset(list):
    def to_list(self) -> list[dict[str, object]]:
        return list(self)


class _FakeDatasetDict(dict):
    pass


def _fake_datasets(monkeypatch, loaded: object) -> None:
    """``datasets`` whose ``load_from_disk`` returns ``loaded`` (the split logic without pyarrow)."""
    module = types.ModuleType("datasets")
    module.DatasetDict = _FakeDatasetDict  # type: ignore[attr-defined]
    module.load_from_disk = lambda path: loaded  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "datasets", module)


def test_a_dataset_dict_is_read_through_its_split(tmp_path, monkeypatch):
    rows = _FakeDataset([{"prompt": "a"}, {"prompt": "b"}])
    _fake_datasets(monkeypatch, _FakeDatasetDict(train=rows, test=_FakeDataset()))
    records = read_records(tmp_path, split="train")
    assert [r.fields["prompt"] for r in records] == ["a", "b"]
    assert records[1].where == f"{tmp_path} split 'train' row 1"
    with pytest.raises(
        DataFileError, match=r"holds the splits \['test', 'train'\], and no split 'validation'"
    ):
        read_records(tmp_path, split="validation")
    with pytest.raises(DataFileError, match="split 'test' is empty"):
        read_records(tmp_path, split="test")
    _fake_datasets(monkeypatch, rows)  # a single Dataset: the split is not needed
    assert read_records(tmp_path, split="anything")[0].where == f"{tmp_path} row 0"


def test_a_real_datasets_directory_with_messages(tmp_path):
    datasets = pytest.importorskip("datasets")
    conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    train = datasets.Dataset.from_list([{"messages": conversation}, {"messages": conversation[:1]}])
    datasets.DatasetDict(train=train, test=train.select([0])).save_to_disk(str(tmp_path / "ds"))
    records = read_records(tmp_path / "ds", split="train")
    assert [r.fields["messages"] for r in records] == [conversation, conversation[:1]]
    assert len(read_records(tmp_path / "ds", split="test")) == 1
    (tmp_path / "plain").mkdir()
    with pytest.raises(DataFileError, match="not a datasets directory saved with save_to_disk"):
        read_records(tmp_path / "plain")


def test_holdout_split_is_seeded_disjoint_and_complete():
    items = list(range(20))
    train, val = split_holdout(items, 0.25, seed=1)
    assert len(val) == 5 and sorted(train + val) == items
    assert split_holdout(items, 0.25, seed=1) == (train, val)
    assert split_holdout(items, 0.25, seed=2) != (train, val)
    assert split_holdout([1, 2], 0.1, seed=0)[1] != []
    assert split_holdout(items, 0.0, seed=0) == (items, [])

"""Caches damaged on disk (issue 37, item 3): the prepared-rows Arrow file cut short, emptied, bit-flipped, swapped
for another key's or left without its seal is noticed before `datasets` reads it, named in a warning and rebuilt,
so a start never trains on fewer or other rows in silence; the seals themselves (vision_grpo/storage/seals.py)."""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from pathlib import Path

import datasets
import pytest
from test_data_cache import MAX_PIXELS, recipe, write_source
from trl import GRPOConfig, ModelConfig

from vision_grpo.data import get_dataset
from vision_grpo.data.prepared import ROWS_CACHE
from vision_grpo.recipe.arguments import TaskArguments
from vision_grpo.recipe.parse import parse_recipe
from vision_grpo.storage.seals import seal, seal_fault, seal_path

ANSWERS = [str(i % 9) for i in range(400)]


def rows_of(argv: list[str]) -> list[tuple[str, int]]:
    args = parse_recipe((TaskArguments, GRPOConfig, ModelConfig), argv)[0]
    rows = get_dataset(args, "train", MAX_PIXELS)
    return list(zip(rows["id"], rows["answer"], strict=True))


def rows_cache(cache_root: Path) -> Path:
    (cache,) = (cache_root / ROWS_CACHE).glob("*.arrow")
    return cache


def truncate_to_few_kb(cache: Path, other: Path) -> None:
    cache.write_bytes(cache.read_bytes()[:4096])


def empty(cache: Path, other: Path) -> None:
    cache.write_bytes(b"")


def cut_at_a_record_boundary(cache: Path, other: Path) -> None:
    """The last 100 rows dropped: what is left is a valid stream of fewer rows, which `datasets` reads silently."""
    import pyarrow as pa

    with pa.memory_map(str(cache)) as source:
        table = pa.ipc.open_stream(source).read_all()
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table.slice(0, len(table) - 100))
    cache.write_bytes(sink.getvalue().to_pybytes())


def flip_a_bit(cache: Path, other: Path) -> None:
    data = bytearray(cache.read_bytes())
    data[len(data) - 200] ^= 0x04  # inside the last batch's answers: another value, same structure
    cache.write_bytes(bytes(data))


def swap_for_another_keys(cache: Path, other: Path) -> None:
    shutil.copyfile(other, cache)


def swap_with_its_seal(cache: Path, other: Path) -> None:
    shutil.copyfile(other, cache)
    if seal_path(other).exists():
        shutil.copyfile(seal_path(other), seal_path(cache))


def drop_the_seal(cache: Path, other: Path) -> None:
    seal_path(cache).unlink(missing_ok=True)


@pytest.mark.parametrize(
    "damage",
    [truncate_to_few_kb, empty, cut_at_a_record_boundary, flip_a_bit, swap_for_another_keys, swap_with_its_seal,
     drop_the_seal],
)  # fmt: skip
def test_a_damaged_rows_cache_is_named_and_rebuilt(
    damage: Callable[[Path, Path], None],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    other_folder = write_source(tmp_path / "other", ANSWERS[::-1])
    rows_of(recipe(other_folder))
    other = rows_cache(tmp_path / "cache")
    (tmp_path / "aside").mkdir()
    if seal_path(other).exists():  # (so that the test runs on code without seals, and fails there)
        shutil.move(seal_path(other), tmp_path / "aside")
    other = Path(shutil.move(other, tmp_path / "aside"))  # another key's cache, kept aside
    folder = write_source(tmp_path / "data", ANSWERS)
    expected = rows_of(recipe(folder))
    cache = rows_cache(tmp_path / "cache")
    damage(cache, other)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vision_grpo.data.prepared"):
        assert rows_of(recipe(folder)) == expected
    assert f"the rows cache {cache} cannot be used" in caplog.text
    assert seal_fault(cache, **_identity(cache)) is None  # rebuilt and sealed again
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="vision_grpo.data.prepared"):
        assert rows_of(recipe(folder)) == expected
    assert "read from the cache" in caplog.text and "cannot be used" not in caplog.text


def _identity(cache: Path) -> dict:
    import json

    return json.loads(seal_path(cache).read_text())["identity"]


def test_a_seal_names_each_fault(tmp_path: Path) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"\0" * 100)
    assert (
        seal_fault(folder, model="m")
        == f"{folder} has no seal model.seal.json (written by an older version, or cut off before its seal)"
    )  # noqa: E501
    seal(folder, model="m")
    assert seal_fault(folder, model="m") is None
    assert "was made for {'model': 'm'}, not {'model': 'n'}" in seal_fault(folder, model="n")
    (folder / "model.safetensors").write_bytes(b"\0" * 99)
    assert seal_fault(folder, model="m") == (
        f"{folder / 'model.safetensors'} holds 99 bytes, sealed with 100 (cut short, grown or replaced)"
    )
    (folder / "model.safetensors").write_bytes(b"\1" + b"\0" * 99)
    assert "model.safetensors is corrupted" in seal_fault(folder, model="m")
    (folder / "model.safetensors").unlink()
    assert seal_fault(folder, model="m") == f"{folder}: model.safetensors is missing"
    seal_path(folder).write_text("{")
    assert seal_fault(folder, model="m") == f"its seal {seal_path(folder)} is unreadable or damaged"


def _cut(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x10  # inside the last tensor: another weight, a valid file
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("damage", "named"),
    [
        (_cut, "model.safetensors holds"),
        (_flip, "model.safetensors is corrupted"),
        (Path.unlink, "model.safetensors is missing"),
        (lambda weights: seal_path(weights.parent).unlink(), "has no seal"),
    ],
)
def test_a_damaged_embedded_replica_is_named_and_rebuilt(
    damage: Callable[[Path], None],
    named: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    from safetensors.torch import load_file

    from vision_grpo.models.embedded import TINY_MODEL, resolve_model_path

    monkeypatch.setenv("VISION_GRPO_CACHE", str(tmp_path))
    target = Path(resolve_model_path(TINY_MODEL))
    weights = target / "model.safetensors"
    before = {name: tensor.clone() for name, tensor in load_file(weights).items()}  # not the file's mapped pages
    damage(weights)
    with caplog.at_level(logging.WARNING, logger="vision_grpo.models.embedded"):
        assert resolve_model_path(TINY_MODEL) == str(target)
    assert f"the embedded model {target} cannot be used" in caplog.text and named in caplog.text
    after = load_file(weights)
    assert after.keys() == before.keys() and all((after[k] == before[k]).all() for k in before)
    assert seal_fault(target, model=TINY_MODEL) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [target.name, target.name + ".lock", seal_path(target).name]
    )  # no staging folder left


def test_datasets_alone_reuses_a_damaged_cache_file_which_is_why_the_rows_cache_is_sealed(tmp_path: Path) -> None:
    """What the seal adds to `datasets`' own cache (data/prepared.py `_trusted`): `Dataset.map` reuses a cache file
    found under its name without reading its bytes, so a flipped bit is read as another row in silence, and a file
    cut short fails in Arrow naming no file. The day `datasets` checks its files, this fails and the seal can go."""
    source = datasets.Dataset.from_dict({"text": [f"row {i}" for i in range(2000)]})
    path = tmp_path / "rows.arrow"

    def rows() -> datasets.Dataset:
        return source.map(lambda row: {"upper": row["text"].upper()}, cache_file_name=str(path), new_fingerprint="k")

    assert rows()[1234]["upper"] == "ROW 1234"
    data = bytearray(path.read_bytes())
    data[data.index(b"ROW 1234") + 4] ^= 0x02  # "1" becomes "3"
    path.write_bytes(data)
    assert rows()[1234]["upper"] == "ROW 3234"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(OSError) as cut:
        rows()
    assert str(path) not in str(cut.value) and path.name not in str(cut.value)

"""A Hub dataset read offline from the Hub cache as `hf download` lays it out (snapshot folders of links into blobs,
`refs/` naming commits), at the pinned revision: `datasets` alone offline reads its newest Arrow cache of the name,
whatever the revision, or fails."""

from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path

import datasets
import huggingface_hub
import pyarrow.parquet as pq
import pytest
from trl import GRPOConfig, ModelConfig

from vision_grpo.data import get_dataset
from vision_grpo.data.geoqa import GeoQADataError, load_source
from vision_grpo.data.hub import HubDataUnavailable
from vision_grpo.data.vqa_fixtures import write_fixtures
from vision_grpo.recipe.arguments import TaskArguments
from vision_grpo.recipe.parse import parse_recipe

REPO = "someone/geometry3k"
OLD, NEW = "1" * 40, "2" * 40  # two commits of the repo: the old one has every row, `main` (NEW) the first 20
MAX_PIXELS = 168 * 168
SPLITS = ("train", "test")


def write_snapshot(cache: Path, commit: str, files: dict[str, bytes], refs: tuple[str, ...] = ()) -> Path:
    """One commit of dataset `REPO` in the Hub cache `cache`, as huggingface_hub stores a download: each file's bytes
    in `blobs/<sha256>`, linked from `snapshots/<commit>/<path>`; each of `refs` names the commit."""
    folder = cache / f"datasets--{REPO.replace('/', '--')}"
    for path, data in files.items():
        blob = folder / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = folder / "snapshots" / commit / path
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (folder / "refs").mkdir(exist_ok=True)
        (folder / "refs" / ref).write_text(commit)
    return folder / "snapshots" / commit


@pytest.fixture(scope="module")
def parquet_files(tmp_path_factory) -> dict[str, bytes]:
    """The geometry3k fixture's splits as the Hub names parquet files (`data/<split>-00000-of-00001.parquet`)."""
    folder = write_fixtures(tmp_path_factory.mktemp("vqa")) / "geometry3k"
    return {f"data/{split}-00000-of-00001.parquet": (folder / f"{split}.parquet").read_bytes() for split in SPLITS}


SPLITS = ("train", "test")


def first_rows(parquet: bytes, count: int) -> bytes:
    """A parquet file of the first `count` rows of `parquet`."""
    out = io.BytesIO()
    pq.write_table(pq.read_table(io.BytesIO(parquet)).slice(0, count), out)
    return out.getvalue()


@pytest.fixture
def hub_cache(tmp_path: Path, parquet_files: dict[str, bytes], monkeypatch: pytest.MonkeyPatch) -> Path:
    """A Hub cache holding two commits of `REPO`, `main` at the newer; the Hub offline, a datasets cache of its own."""
    cache = tmp_path / "hub"
    write_snapshot(cache, OLD, parquet_files)
    train = "data/train-00000-of-00001.parquet"
    write_snapshot(cache, NEW, {**parquet_files, train: first_rows(parquet_files[train], 20)}, ("main",))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets")
    return cache


def vqa_rows(revision: str | None, split: str = "train") -> datasets.Dataset:
    argv = ["--config", "recipes/vqa/tiny_geometry3k.yaml", "--dataset_name", REPO, "--use_cpu", "true"]
    argv += ["--dataset_revision", revision] if revision else []
    task_args = parse_recipe((TaskArguments, GRPOConfig, ModelConfig), argv)[0]
    return get_dataset(task_args, split, MAX_PIXELS)


def test_a_pinned_commit_is_read_from_the_hub_cache_offline_whatever_was_read_before(hub_cache: Path) -> None:
    assert len(vqa_rows(None)) == 20  # no revision: `main`, through refs/main
    old = vqa_rows(OLD)  # after `main` was read and cached: `datasets` offline would hand back main's rows
    assert len(old) == 48
    assert old[0]["id"] == "train-0" and old[47]["id"] == "train-47"
    assert len(vqa_rows(NEW)) == 20
    assert len(vqa_rows(OLD, "eval")) == 16
    assert old.cache_files and all("vision_grpo_rows" in f["filename"] or OLD in f["filename"] for f in old.cache_files)


def test_a_revision_the_hub_cache_lacks_is_named_with_how_to_fetch_it(hub_cache: Path) -> None:
    missing = "3" * 40
    named = rf"{REPO} at revision {missing} is not in the Hub cache \({hub_cache}"
    with pytest.raises(HubDataUnavailable, match=named):
        vqa_rows(missing)
    with pytest.raises(HubDataUnavailable, match=rf"hf download {REPO} --repo-type dataset --revision v9"):
        vqa_rows("v9")  # a branch the cache has no ref for


def test_a_snapshot_without_the_split_s_files_says_so(hub_cache: Path, parquet_files: dict[str, bytes]) -> None:
    only_test = {"data/test-00000-of-00001.parquet": parquet_files["data/test-00000-of-00001.parquet"]}
    partial = "4" * 40
    write_snapshot(hub_cache, partial, only_test)  # `hf download --include "data/test*"`
    with pytest.raises(HubDataUnavailable, match=r"holds no files of split 'train' \(splits found: \['test'\]\)"):
        vqa_rows(partial)


def test_geoqa_from_the_hub_offline_names_the_revision_and_both_ways_out(hub_cache: Path) -> None:
    with pytest.raises(GeoQADataError, match=r"hz2475/geoQA at revision 0{40} is not in the Hub cache .*prepare"):
        load_source("hz2475/geoQA", "0" * 40)

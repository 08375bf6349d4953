"""A Hub dataset read at its pinned revision from the local Hub cache where that cache holds it, else from the Hub.

`datasets` downloads a Hub dataset's files into the Hub cache (`HF_HUB_CACHE`: `datasets--<owner>--<name>/`, its
`snapshots/<commit>/` folders of links into `blobs/`, and `refs/<branch>` naming a commit), but offline it does not
read them: it falls back to the newest Arrow cache of the name it finds under `HF_DATASETS_CACHE`, whatever its
revision, or fails. So a node behind a firewall, given the files by `hf download --repo-type dataset`, could not train,
and a revision pin was not honoured offline. Here a snapshot of the revision in the Hub cache is read as the local
folder it is, by the reader that reads the Hub: split names from the file names or the README's `configs`, as the
Hub names them, and parquet with `datasets`' pre-buffering off, as every local parquet source is
(`prepared.PARQUET_READ`: the first start's memory grows with a row group, not the file). A full commit is
immutable, so its snapshot is used online too; a branch (or no revision: `main`) goes to the Hub while it is
reachable and is resolved by the cache's `refs/` offline.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import datasets
import huggingface_hub
from huggingface_hub.errors import LocalEntryNotFoundError

from vision_grpo.data.prepared import PARQUET_READ

logger = logging.getLogger(__name__)

COMMIT = re.compile(r"[0-9a-f]{40}")


class HubDataUnavailable(ValueError):
    """A Hub dataset that neither the Hub cache nor the Hub can give at the revision asked for."""


def load(repo_id: str, revision: str | None, split: str) -> datasets.Dataset:
    """The rows of `split` of the Hub dataset `repo_id` at `revision` (a commit, a branch or tag, None: `main`)."""
    offline = huggingface_hub.constants.HF_HUB_OFFLINE
    at = f" at revision {revision}" if revision else " (no dataset_revision: the cache's `main`)"
    snapshot = cached_snapshot(repo_id, revision) if offline or COMMIT.fullmatch(revision or "") else None
    if snapshot is not None:
        logger.info("%s%s: read from the Hub cache, %s", repo_id, at, snapshot)
        return read(str(snapshot), None, split, f"{repo_id}{at} ({snapshot})")
    if offline:
        raise HubDataUnavailable(
            f"{repo_id}{at} is not in the Hub cache ({huggingface_hub.constants.HF_HUB_CACHE}) and the Hub is "
            "offline (HF_HUB_OFFLINE=1). Where the Hub is reachable, fetch it into that cache with `hf download "
            f"{repo_id} --repo-type dataset{f' --revision {revision}' if revision else ''}`, or set dataset_name "
            "to a local copy"
        )
    return read(repo_id, revision, split, f"{repo_id}{at}")


def cached_snapshot(repo_id: str, revision: str | None) -> Path | None:
    """The Hub cache's snapshot folder of dataset `repo_id` at `revision` (a branch through its `refs/` file), or
    None where the cache has none. Never reaches the network."""
    try:
        found = huggingface_hub.snapshot_download(
            repo_id, repo_type="dataset", revision=revision, local_files_only=True
        )
    except LocalEntryNotFoundError:
        return None
    return Path(found)


def read(name: str, revision: str | None, split: str, what: str) -> datasets.Dataset:
    """`split` of `name`, a Hub id or a folder laid out as a Hub dataset repo (`data/train-00000-of-00001.parquet`,
    `train/*.parquet`, a README's `configs`, ...), whose splits `datasets` infers from that layout; parquet is read
    with pre-buffering off. `what` names the source in errors."""
    builder = datasets.load_dataset_builder(name, revision=revision)
    options = PARQUET_READ if builder.name == "parquet" else {}
    splits = sorted(builder.config.data_files or {})
    if split not in splits:
        raise HubDataUnavailable(
            f"{what} holds no files of split {split!r} (splits found: {splits or 'none'}). A download limited by "
            "--include may have left them out: fetch the whole revision with `hf download`"
        )
    return datasets.load_dataset(name, revision=revision, split=split, **options)

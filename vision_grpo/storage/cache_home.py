"""Where caches live when nobody said: the one place that reads HOME for a cache path.

With HOME empty, `~` expands to "" and every cache under `~/.cache` landed at the filesystem root (`/.cache/...`:
refused for an ordinary account, written there in silence as root); with HOME unset, Python looks the account up,
and a container's user with no entry in /etc/passwd has none (`Path.home()` raises). A cron job or `env -i` runs
that way. Then the caches go under the temporary directory instead, in a folder of this account's own.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def user_cache_home() -> Path:
    """`$XDG_CACHE_HOME`, else `$HOME/.cache`, else (HOME empty or unset) `<temporary directory>/cache-<uid>`: per
    account, so that another account's folder of the same name is never read or written."""
    if xdg := os.environ.get("XDG_CACHE_HOME"):
        return Path(xdg)
    if home := os.environ.get("HOME"):
        return Path(home) / ".cache"
    return Path(tempfile.gettempdir()) / f"cache-{os.getuid()}"


def vision_grpo_cache() -> Path:
    """Our cache (the embedded replicas, remembered digests): `$VISION_GRPO_CACHE`, else `<user cache>/vision_grpo`.
    Never inside the repository's git."""
    return Path(os.environ.get("VISION_GRPO_CACHE") or user_cache_home() / "vision_grpo")


def hf_home_without_home() -> None:
    """With HOME empty or unset (and neither HF_HOME nor XDG_CACHE_HOME set), point HF_HOME at the same fallback.

    huggingface_hub and datasets derive their caches (downloads, our checked rows) from `~` when first imported, so
    this runs when `vision_grpo` is imported, which every entry point does before it imports them.
    """
    if not os.environ.get("HOME") and not os.environ.get("HF_HOME") and not os.environ.get("XDG_CACHE_HOME"):
        os.environ["HF_HOME"] = str(user_cache_home() / "huggingface")

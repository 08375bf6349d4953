"""Writing files so that a crash or a full disk loses nothing finished: atomic writes, a full disk named with its
path and the space the write needed, seals that tell a cache file (or folder) damaged on disk from a good one, and
where caches live (cache_home.py). The lowest layer: every other sub-package may use it, it uses none of them.
"""

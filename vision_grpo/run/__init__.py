"""One run of an entry point: its run folder and manifest, atomic writes, locks and checksums, resuming, deciding on
the main process for all ranks, the graceful stop on signals, thread counts, the launcher guard. May import models,
data, rewards, recipe and plugins; not plan. Imports nothing itself: entry points import `run.launched` first.
"""

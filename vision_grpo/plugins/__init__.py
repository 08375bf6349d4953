"""Plugins: finding and importing plugin files, the reward registry behind rewards/, the task registry behind data/,
and which reward call runs now. The bottom layer: imports nothing of the package.
"""

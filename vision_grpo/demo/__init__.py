"""`make demo` (`python -m vision_grpo.demo`): the two CPU experiments, their stages, report tables and plot.

Top layer, beside export: may import every layer below; nothing in the library imports it.
"""

"""Shipping a trained policy: `python -m vision_grpo.export` merges an adapter into a standalone model folder with a
model card. Top layer, beside demo: may import every layer below; nothing in the library imports it.
"""

"""Models: the one path from `model_name_or_path` to `from_pretrained`, processors, the embedded replicas, LoRA,
the vision tower and tokens, vLLM's prompt form and the visual-token check. May import data, rewards, recipe, plugins.
"""

"""The memory plan of a recipe (`python -m vision_grpo.plan`): per-part formulas, the plan built from the model's
config alone, the check before training. May import models, data, rewards, recipe and plugins; not run.
"""

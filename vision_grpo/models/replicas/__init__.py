"""The builders of the embedded replicas (`vision-grpo/tiny-qwen2.5-vl`, `-qwen3-vl`, `-qwen3.5`): each family's
classes, template, tokens and toy sizes, and the build into a Hub-shaped folder. Imports only models.processing.
"""

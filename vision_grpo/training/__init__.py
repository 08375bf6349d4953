"""Training on TRL: the GRPOTrainer subclass, vLLM generation for Qwen-VL prompts, the logprob-gap guard and the
trainer callbacks (held-out curve, HParams). May import evaluation and everything below it, never demo or export.
"""

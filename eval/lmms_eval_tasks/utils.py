"""The lmms-eval tasks' functions: this repository's own (vision_grpo/evaluation/outside_evaluators.py), so lmms-eval
renders the prompt and scores the answer exactly as `eval/evaluate.py` does."""

from vision_grpo.evaluation.outside_evaluators import doc_to_messages, doc_to_text, doc_to_visual, process_results

__all__ = ["doc_to_messages", "doc_to_text", "doc_to_visual", "process_results"]

"""Evaluation: the evaluator (greedy batched generation, scored per example), its batches, result files and the
`eval/evaluate.py` command's body, the vLLM backend, adapters, pass@k, comparisons and their statistics. May import
run, plan, models and below; never training.
"""

"""`python -m vision_grpo.pass_at_k` moved: pass@k is the command `python eval/pass_at_k.py` (same arguments), its
library vision_grpo/evaluation/pass_at_k.py. Running the old name says so and exits 2.
"""

import sys

if __name__ == "__main__":
    print(
        "python -m vision_grpo.pass_at_k moved: run `python eval/pass_at_k.py` with the same arguments "
        "(its library is vision_grpo.evaluation.pass_at_k)",
        file=sys.stderr,
    )
    sys.exit(2)

"""What the multi-process and vision-tower tests need to see from inside a real training run.

Every process appends JSON lines to `$VISION_GRPO_TEST_RECORD/rank<N>.jsonl` (one file per process, so ranks never
interleave writes); the tests read them back after the run. Nothing here changes what training does.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

RECORD_ENV = "VISION_GRPO_TEST_RECORD"
# Set: the recorded run pushes the model towards sampling vision special tokens (train_recorded.force_vision_tokens).
FORCE_ENV = "VISION_GRPO_TEST_FORCE_VISION_TOKENS"
# Set: DeepSpeed on CPU communicates through torch.distributed (gloo) instead of its shared-memory kernel.
GLOO_ONLY_ENV = "VISION_GRPO_TEST_DEEPSPEED_GLOO_ONLY"


def record(event: str, **fields: Any) -> None:
    """Append one event of this process, tagged with its rank and the world size, if recording is on."""
    folder = os.environ.get(RECORD_ENV)
    if not folder:
        return
    from accelerate import PartialState

    state = PartialState()
    line = {"event": event, "rank": state.process_index, "world_size": state.num_processes, **fields}
    with open(Path(folder) / f"rank{state.process_index}.jsonl", "a", encoding="utf-8") as file:
        file.write(json.dumps(line) + "\n")


def read_records(folder: Path, event: str) -> list[dict[str, Any]]:
    """All events named `event` of all processes, in file order per rank."""
    events = []
    for path in sorted(Path(folder).glob("rank*.jsonl")):
        events += [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    return [line for line in events if line["event"] == event]


def parameter_checksums(model: Any, is_vision: Any) -> dict[str, str]:
    """SHA-256 of the parameters, by part: `vision` tower, `lora` adapters, the rest (`language`), and `all`.

    Bit-level hashes, so "identical" means identical and any update, however small, shows.
    """
    hashes = {part: hashlib.sha256() for part in ("vision", "lora", "language", "all")}
    for name, parameter in sorted(model.named_parameters()):
        part = "lora" if "lora_" in name else "vision" if is_vision(name) else "language"
        data = name.encode() + parameter.detach().float().cpu().numpy().tobytes()
        hashes[part].update(data)
        hashes["all"].update(data)
    return {part: digest.hexdigest() for part, digest in hashes.items()}


RECORDING = Path(__file__).resolve().parent
TINY_RECIPE = "recipes/shapes/tiny_cpu.yaml"


def recorded_training_args(run_dir: Path, *overrides: str) -> list[str]:
    """Arguments of a recorded tiny training into `run_dir`: 2 steps, the distinct-characters reward, no checkpoints."""
    return [
        str(RECORDING / "train_recorded.py"),
        "--config",
        TINY_RECIPE,
        "--output_dir",
        str(run_dir.parent),
        "--run_name",
        run_dir.name,
        "--max_steps",
        "2",
        "--save_strategy",
        "no",
        "--reward_dirs",
        str(RECORDING / "rewards"),
        "--reward_funcs",
        "distinct_characters",
        "--reward_weights",
        "1.0",
        *overrides,
    ]


def force_vision_tokens(model):
    """Bias the output logits towards every vision special token (+50), on every forward pass."""
    config = model.config
    vision_ids = [config.image_token_id, config.video_token_id, config.vision_start_token_id]
    vision_ids.append(config.vision_end_token_id)

    def bias(module, inputs, output):
        output[..., vision_ids] += 50.0
        return output

    model.get_output_embeddings().register_forward_hook(bias)
    return model

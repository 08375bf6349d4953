"""The training pass that pays only for signal (vision_grpo/models/shared_prompt.py, vision_grpo/training/): each
prompt forwarded once per group gives the per-copy log-probs, entropies and gradients in every family and training
set-up; micro-batches of whole groups, cut and balanced, with rows of advantage 0 left out, give TRL's update; what
the packing does not know falls back to the per-copy forward with one warning.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from conftest import FAMILY_MODELS, run_script
from peft import get_peft_model
from PIL import Image
from safetensors.torch import load_file
from trl import ModelConfig
from trl.trainer.utils import add_fused_lm_head

from vision_grpo.models.loading import get_processor, load_model
from vision_grpo.models.lora import get_peft_config
from vision_grpo.models.shared_prompt import CannotPack, Groups, find_groups, pack, unpack
from vision_grpo.recipe.arguments import TaskArguments
from vision_grpo.training.micro_batches import loss_scale, micro_batches, padded, plan, take

G = 3
WIDTH = 9  # completion columns; the rows' completions are 9, 4, 7, 2, 9 and 5 tokens


def _image(height: int, seed: int) -> Image.Image:
    generator = torch.Generator().manual_seed(seed)
    return Image.fromarray((torch.rand(height, 96, 3, generator=generator) * 255).byte().numpy())


def _rows(processor, pad_id: int) -> dict:
    """Two prompts of different lengths and images, G completions each, as TRL lays them out: prompts left-padded,
    completions right-padded."""

    def prompt(text: str) -> str:
        content = [{"type": "image"}, {"type": "text", "text": text}]
        return processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)

    texts = [prompt("How many?")] * G + [prompt("Count the shapes, please.")] * G
    images = [_image(64, 0)] * G + [_image(96, 2)] * G
    encoded = processor(text=texts, images=images, return_tensors="pt", padding=True, padding_side="left")
    generator = torch.Generator().manual_seed(3)
    lengths = torch.tensor([9, 4, 7, 2, 9, 5])
    mask = (torch.arange(WIDTH)[None] < lengths[:, None]).long()
    completion = torch.randint(10, 300, (2 * G, WIDTH), generator=generator) * mask + pad_id * (1 - mask)
    return {
        "prompt_ids": encoded["input_ids"],
        "prompt_mask": encoded["attention_mask"],
        "completion_ids": completion,
        "completion_mask": mask,
        "pixel_values": encoded["pixel_values"],
        "image_grid_thw": encoded["image_grid_thw"],
        "num_images": [1] * (2 * G),
        "mm_token_type_ids": torch.cat([encoded["mm_token_type_ids"], torch.zeros_like(completion)], dim=1),
    }


def _model(name: str, setup: str):
    """The replica in train mode, set up as a recipe would: `full` (every parameter trainable, the vision tower
    too), `lora` (LoRA on the language model and on the vision tower); activation checkpointing on in both."""
    args = ModelConfig(
        model_name_or_path=name,
        dtype="float32",
        use_peft=setup == "lora",
        lora_r=4,
        lora_alpha=8,
        lora_dropout=0.0,
    )
    model, processor = load_model(args), get_processor(args, TaskArguments())
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    if setup == "lora":
        model = get_peft_model(model, get_peft_config(args, TaskArguments(lora_on_vision=True)))
        with torch.no_grad():  # LoRA's B starts at zero: its gradient would be the only one to check
            for parameter_name, parameter in model.named_parameters():
                if "lora_B" in parameter_name:
                    parameter.normal_(0, 0.02)
    model.activation_checkpointing_enable({"use_reentrant": False})
    model.enable_input_require_grads()
    return model.train(), processor


def _per_copy(model, rows: dict) -> tuple[torch.Tensor, torch.Tensor, int]:
    """TRL's forward: every row its prompt and its completion."""
    ids = torch.cat([rows["prompt_ids"], rows["completion_ids"]], dim=1)
    mask = torch.cat([rows["prompt_mask"], rows["completion_mask"]], dim=1)
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :-WIDTH] = -100
    images = {k: rows[k] for k in ("pixel_values", "image_grid_thw", "mm_token_type_ids")}
    out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True, **images)
    return out.log_probs[:, -WIDTH:], out.entropy[:, -WIDTH:], ids.numel()


def _packed(model, rows: dict) -> tuple[torch.Tensor, torch.Tensor, int]:
    groups = find_groups(
        rows["prompt_ids"], rows["prompt_mask"], rows["completion_mask"], rows["pixel_values"],
        rows["image_grid_thw"], rows["num_images"],
    )  # fmt: skip
    assert groups.rows == [[0, 1, 2], [3, 4, 5]]
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    packed = pack(
        base, groups, rows["prompt_ids"], rows["completion_ids"], rows["mm_token_type_ids"], rows["pixel_values"],
        rows["image_grid_thw"], rows["num_images"],
    )  # fmt: skip
    out = model(**packed.inputs, fused_lm_head=True)
    n = rows["prompt_ids"].shape[0]
    return unpack(out.log_probs, packed, n, WIDTH), unpack(out.entropy, packed, n, WIDTH), packed.positions_computed


def _gradients(model, logps: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    weights = torch.linspace(-1, 1, logps.numel()).view_as(logps)  # a loss that weighs every token differently
    model.zero_grad()
    (logps * weights * mask).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}


@pytest.mark.parametrize("setup", ["full", "lora"])
@pytest.mark.parametrize("name", FAMILY_MODELS)
def test_each_prompt_once_per_group_gives_the_per_copy_logps_and_gradients(name: str, setup: str) -> None:
    model, processor = _model(name, setup)
    rows = _rows(processor, processor.tokenizer.pad_token_id)
    mask = rows["completion_mask"]
    logps, entropy, per_copy_positions = _per_copy(model, rows)
    expected = _gradients(model, logps, mask)
    packed_logps, packed_entropy, packed_positions = _packed(model, rows)
    got = _gradients(model, packed_logps, mask)

    assert ((logps - packed_logps) * mask).abs().max() < 1e-5
    assert ((entropy - packed_entropy) * mask).abs().max() < 1e-5
    assert (packed_logps * (1 - mask)).abs().max() == 0  # no score where a row has no completion token
    assert set(got) == set(expected)
    vision = [n for n in expected if "visual" in n]
    assert vision and all(expected[n].abs().max() > 0 for n in vision)  # the tower's parameters train too
    largest = max(g.abs().max() for g in expected.values())
    assert max((expected[n] - got[n]).abs().max() for n in expected) < 1e-6 * max(1.0, largest)
    # prompt[:-1] once per group, then each completion after a copy of the prompt's last token
    prompts = rows["prompt_mask"].sum(-1)
    assert packed_positions == 2 * max(int(prompts[0]) - 1 + 3 + 20, int(prompts[3]) - 1 + 3 + 16)
    assert packed_positions < per_copy_positions / 2


def test_rows_count_as_one_group_only_with_the_same_prompt_and_the_same_pixels() -> None:
    ids = torch.tensor([[0, 5, 6], [0, 5, 6], [0, 5, 6], [5, 7, 6], [0, 5, 6]])
    prompt_mask = torch.tensor([[0, 1, 1]] * 3 + [[1, 1, 1]] + [[0, 1, 1]])
    pixels = torch.rand(5 * 4, 3)
    pixels[4:8] = pixels[0:4]
    pixels[8:12] = pixels[0:4]
    pixels[8, 0] = torch.nextafter(pixels[8, 0], torch.tensor(2.0))  # row 2's image differs from row 0's in one bit
    pixels[16:20] = pixels[0:4]  # row 4: row 0's prompt and image, not next to it
    grid = torch.tensor([[1, 2, 2]] * 5)
    groups = find_groups(ids, prompt_mask, torch.ones(5, 2, dtype=torch.long), pixels, grid, [1] * 5)
    assert groups.rows == [[0, 1, 4], [2], [3]]
    assert groups.prompt_len == [2, 2, 3]


@pytest.mark.parametrize(
    "mask, reason",
    [
        (torch.tensor([[1, 0, 1]]), "holes"),  # a completion mask with a hole (tool output) cannot be packed
    ],
)
def test_a_completion_mask_with_holes_is_refused(mask: torch.Tensor, reason: str) -> None:
    with pytest.raises(CannotPack, match=reason):
        find_groups(torch.tensor([[5, 6]]), torch.ones(1, 2, dtype=torch.long), mask, None, None, None)


def test_an_attention_implementation_it_does_not_know_is_refused_before_any_forward() -> None:
    model, processor = _model(FAMILY_MODELS[0], "full")
    rows = _rows(processor, processor.tokenizer.pad_token_id)
    groups = find_groups(
        rows["prompt_ids"], rows["prompt_mask"], rows["completion_mask"], rows["pixel_values"],
        rows["image_grid_thw"], rows["num_images"],
    )  # fmt: skip
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(CannotPack, match="flash_attention_2"):
        pack(model, groups, rows["prompt_ids"], rows["completion_ids"], rows["mm_token_type_ids"], None, None, None)


# ---------------------------------------------------------------------------------------------------------------------
# Micro-batches: whole groups, balanced, cut; rows of advantage 0 left out and the normalisers kept.


def _groups(lengths: list[list[int]], prompt: int = 10) -> Groups:
    rows, completion, at = [], [], 0
    for group in lengths:
        rows.append(list(range(at, at + len(group))))
        completion += group
        at += len(group)
    return Groups(rows, [prompt] * len(rows), completion)


def test_whole_groups_are_spread_by_tokens_and_rows_without_advantage_left_out() -> None:
    groups = _groups([[30, 30], [2, 2], [20, 20], [1, 1]])
    advantages = torch.tensor([0.5, -0.5, 0.0, 0.0, 1.0, -1.0, 0.0, 0.0])
    chosen = plan(groups, advantages, count=2, balance=True, skip=True, shared_prompt=True)
    assert sorted(map(sorted, chosen.rows)) == [[0, 1], [4, 5]]  # the dead groups nowhere, the two live apart
    assert chosen.degenerate_groups == 2 and chosen.rows_skipped == 4
    assert chosen.signal_positions == 2 * 10 + 30 + 30 + 20 + 20
    kept = plan(groups, advantages, count=2, balance=True, skip=False, shared_prompt=True)
    # 72, 52, 16 and 14 positions: the longest alone (72), the others together (82)
    assert sorted(map(sorted, kept.rows)) == [[0, 1], [2, 3, 4, 5, 6, 7]]


def test_with_several_processes_every_micro_batch_gets_its_rows_with_advantage_zero() -> None:
    """TRL gathers per-row metrics from every rank: a micro-batch is topped up to the rows the other ranks' have,
    with rows left out first, then copies whose advantage is set to 0."""
    groups = _groups([[5, 5, 5, 5], [3, 3, 3, 3]])
    advantages = torch.tensor([0.5, -0.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    chosen = plan(groups, advantages, count=3, balance=True, skip=True, shared_prompt=True)
    assert [len(rows) for rows in chosen.rows] == [2, 0, 0]  # one process: the empty ones run nothing
    rows, zeroed = padded(chosen, [2, 3, 4])
    assert rows[0] == [0, 1] and zeroed[0] == set()
    assert sorted(rows[1] + rows[2][:3]) == [2, 3, 4, 5, 6, 7]  # the 6 rows left out, advantage 0 already
    assert zeroed[1] == set() and zeroed[2] == {3}  # then a copy, its advantage set to 0
    every = plan(groups, advantages, count=3, balance=True, skip=False, shared_prompt=True)  # nothing left out
    rows, zeroed = padded(every, [5, 4, 2])
    assert rows == [[0, 1, 2, 3, 0], [4, 5, 6, 7], [0, 0]] and zeroed == [{4}, set(), {0, 1}]
    batch = {"prompt_ids": torch.zeros(8, 1, dtype=torch.long), "completion_ids": torch.zeros(8, 1, dtype=torch.long)}
    batch["advantages"] = advantages
    topped = take(batch, rows[0], cut=False, zeroed=zeroed[0])
    assert topped["advantages"].tolist() == [0.5, -0.5, 0.0, 0.0, 0.0] and advantages[0] == 0.5


@pytest.mark.parametrize(
    "loss_type, expected",
    [("grpo", 2 / 4), ("dr_grpo", 2 / 4), ("dapo", 1.0), ("bnpo", (3 + 5) / (3 + 5 + 7 + 1))],
)
def test_the_loss_of_the_rows_left_keeps_the_normaliser_of_the_micro_batch_they_were_in(
    loss_type: str, expected: float
) -> None:
    batch = {"completion_mask": (torch.arange(8)[None] < torch.tensor([3, 5, 7, 1])[:, None]).long()}
    assert loss_scale(loss_type, batch, rows=[0, 1], had=[0, 1, 2, 3], nominal_rows=4) == pytest.approx(expected)
    with pytest.raises(ValueError, match="not known"):
        loss_scale("a_new_loss", batch, [0], [0, 1], 4)


def test_a_micro_batch_is_cut_to_its_own_longest_prompt_and_completion() -> None:
    prompt_mask = torch.tensor([[0, 0, 1, 1], [0, 0, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1]])
    completion_mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 1, 1], [1, 1, 1]])
    batch = {
        "prompt_ids": torch.arange(16).view(4, 4),
        "prompt_mask": prompt_mask,
        "completion_ids": torch.arange(12).view(4, 3),
        "completion_mask": completion_mask,
        "old_per_token_logps": torch.rand(4, 3),
        "mm_token_type_ids": torch.zeros(4, 7, dtype=torch.long),
        "advantages": torch.tensor([1.0, -1.0, 1.0, -1.0]),
        "num_items_in_batch": torch.tensor(9),
    }
    groups = Groups([[0, 1], [2, 3]], [2, 4], [1, 2, 3, 3])
    chosen = plan(groups, batch["advantages"], 2, balance=True, skip=True, shared_prompt=True)
    out = micro_batches(batch, chosen, "dapo", 2, cut=True)
    short = next(mb for mb in out if mb["prompt_ids"].shape[1] == 2)
    assert torch.equal(short["prompt_ids"], batch["prompt_ids"][:2, 2:])
    assert short["completion_ids"].shape == short["old_per_token_logps"].shape == (2, 2)
    assert short["mm_token_type_ids"].shape == (2, 4) and short["num_items_in_batch"] == 9


# ---------------------------------------------------------------------------------------------------------------------
# End to end: the same weights after 3 steps with every saving on and with TRL's path.

REWARD = '''
import zlib
from vision_grpo.rewards import completion_texts, reward


@reward("half_signal")
def half_signal(completions, **kwargs):
    """Signal in about half of the groups: by completion length where the prompt's id hashes odd, else a constant."""
    texts = completion_texts(completions)
    return [float(len(t) % 3 == 0) if zlib.crc32(str(i).encode()) % 2 else 0.3 for t, i in zip(texts, kwargs["id"])]
'''


def _positions(log: str, kind: str) -> list[float]:
    """The per-step `training_pass/positions_<kind>` of a run's log."""
    return [float(x) for x in re.findall(rf"'training_pass/positions_{kind}': '([\d.]+)'", log)]


OFF = ["--share_prompt_in_training", "false", "--balance_micro_batches", "false", "--skip_zero_advantage", "false"]


def _train(
    tmp_path: Path, name: str, *flags: str, wrapper: Path | None = None, launch: list[str] | None = None
) -> tuple[dict[str, torch.Tensor], str]:
    plugins = tmp_path / "plugins"
    plugins.mkdir(exist_ok=True)
    (plugins / "half_signal.py").write_text(REWARD)
    args = [*(launch or []), *([str(wrapper)] if wrapper else []), "recipes/train.py"]
    args += ["--config", "recipes/shapes/tiny_cpu.yaml"]
    args += ["--output_dir", str(tmp_path / "runs")]
    args += ["--run_name", name, "--reward_dirs", str(plugins), "--reward_funcs", "half_signal"]
    args += ["--reward_weights", "1", "--max_steps", "3", "--save_steps", "100", "--report_to", "none"]
    args += ["--max_completion_length", "12", "--per_device_train_batch_size", "8", "--lora_dropout", "0"]
    args += ["--gradient_accumulation_steps", "2", "--activation_checkpointing", "true", *flags]
    process = run_script(args, timeout=900)
    return load_file(tmp_path / "runs" / name / "adapter_model.safetensors"), process.stdout + process.stderr


@pytest.mark.parametrize(
    "loss_type, both, ours",
    [
        ("dr_grpo", [], []),
        ("grpo", [], []),
        ("dapo", [], []),
        ("grpo", [], ["--balance_micro_batches", "false"]),  # TRL's shuffled micro-batches, packed where they can
        ("dapo", ["--num_iterations", "2"], []),  # the old policy's log-probs, packed too
        ("grpo", ["--beta", "0.04"], []),  # the reference's log-probs, packed; no row left out (the KL reads them)
    ],
)
def test_three_steps_train_the_same_weights_as_trls_path(
    tmp_path: Path, loss_type: str, both: list[str], ours: list[str]
) -> None:
    """16 completions a step in 2 micro-batches of 8 (2 groups each), about half the groups without signal. SGD,
    so that the weights show the gradients' sum itself: AdamW divides each coordinate by its own running size,
    which turns float round-off in a near-zero gradient into a visible step (docs/performance.md)."""
    sgd = ["--loss_type", loss_type, "--optim", "sgd", "--learning_rate", "1.0", *both]
    before, trl_log = _train(tmp_path, "trl", *sgd, *OFF)
    after, log = _train(tmp_path, "ours", *sgd, *ours)
    _assert_same_training(before, after, log, trl_log, rows_left_out="--beta" not in both)


def _assert_same_training(before: dict, after: dict, log: str, trl_log: str, rows_left_out: bool) -> None:
    moved = max(before[k].abs().max() for k in before if "lora_B" in k)
    assert moved > 1e-3  # the steps trained: LoRA's B starts at zero
    assert max((before[k] - after[k]).abs().max() for k in before) < 1e-6 * moved / 1e-3
    skipped = [float(x) for x in re.findall(r"'training_pass/rows_skipped': '([\d.]+)'", log)]
    degenerate = [float(x) for x in re.findall(r"'degenerate_fraction': '([\d.]+)'", log)]
    assert len(skipped) == len(degenerate) > 0 and max(degenerate) > 0  # one of each per generation batch
    assert (sum(skipped) > 0) == rows_left_out
    computed, signal = _positions(log, "computed"), _positions(log, "with_signal")
    if len(computed) == len(signal):  # one generation batch a step (not with num_iterations 2)
        assert all(s <= c for s, c in zip(signal, computed, strict=True))
    assert sum(computed) < sum(_positions(trl_log, "computed")) / (2 if rows_left_out else 1)


# `accelerate launch ... gloo_only.py recipes/train.py <args>`: DeepSpeed on CPU through gloo, not the shared-memory
# kernel it would compile for minutes (as tests/recording/train_recorded.py does).
GLOO_ONLY = """
import runpy
import sys

import deepspeed.ops

deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.slow
@pytest.mark.parametrize("config", ["cpu", "zero3"])
def test_two_processes_train_the_same_weights_as_trls_path(tmp_path: Path, config: str) -> None:
    """DDP and DeepSpeed ZeRO-3 on 2 processes: each rank runs every micro-batch with as many rows as the other
    (topped up with rows of advantage 0), and the adapters match TRL's path's."""
    wrapper = tmp_path / "gloo_only.py"
    wrapper.write_text(GLOO_ONLY)
    launch = ["-m", "accelerate.commands.launch", "--config_file", f"accelerate_configs/{config}.yaml"]
    launch += ["--num_processes", "2", "--main_process_port", "0"]
    launch += ["--mixed_precision", "no"] if config != "cpu" else []
    sgd = ["--loss_type", "dr_grpo", "--optim", "sgd", "--learning_rate", "1.0"]
    before, trl_log = _train(tmp_path, "trl", *sgd, *OFF, wrapper=wrapper, launch=launch)
    after, log = _train(tmp_path, "ours", *sgd, wrapper=wrapper, launch=launch)
    _assert_same_training(before, after, log, trl_log, rows_left_out=True)


# `python unknown_layer.py <script> <args>`: the script, with Qwen3.5's Gated DeltaNet unknown to the packing, as a
# new family's linear-attention layer would be.
UNKNOWN_LAYER = """
import runpy
import sys

from vision_grpo.models import prefix_states

prefix_states.CONTINUABLE = frozenset()
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_a_layer_the_packing_does_not_know_trains_on_the_per_copy_path_with_one_warning(tmp_path: Path) -> None:
    wrapper = tmp_path / "unknown_layer.py"
    wrapper.write_text(UNKNOWN_LAYER)
    _, log = _train(tmp_path, "unknown", "--model_name_or_path", "vision-grpo/tiny-qwen3.5", wrapper=wrapper)
    assert log.count("prompt sharing in the training pass off: linear-attention layers it does not know") == 1
    computed, signal = _positions(log, "computed"), _positions(log, "with_signal")
    assert len(computed) == 3 and all(c >= 2 * s for c, s in zip(computed, signal, strict=True) if s)

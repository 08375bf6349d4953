"""The vLLM fixes and the logprob-gap guard without a vLLM build (engine and server replaced by fakes that expand
image placeholders as vLLM does). The same code runs against a real CPU vLLM build in tests_vllm/."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
from PIL import Image
from trl import GRPOConfig, ModelConfig
from trl.generation.vllm_generation import VLLMGeneration

from vision_grpo.models.processing import load_processor
from vision_grpo.models.vision import vision_special_token_ids
from vision_grpo.models.vllm_prompts import (
    NEVER,
    PromptMismatchError,
    check_engine_prompt,
    collapse_image_runs,
    pixel_kwargs,
)
from vision_grpo.recipe.arguments import RecipeError, TaskArguments
from vision_grpo.recipe.parse import parse_recipe
from vision_grpo.training.logprob_guard import GAP_KEY, LogprobGapError, LogprobGapGuard
from vision_grpo.training.vllm_generation import VisionPromptEngine, VisionVLLMGeneration, copy_groups

PAD = 7  # an image token id for the pure-list tests


@pytest.fixture(scope="module")
def processor(tiny_model_path):
    return load_processor(str(tiny_model_path), None, None)


@pytest.fixture(scope="module")
def rendered(processor):
    """The processor's expanded prompt ids for one image, and the template's un-expanded ids for the same prompt."""
    from PIL import Image

    messages = [{"role": "user", "content": [{"type": "image", "image": Image.new("RGB", (140, 140))}]}]
    expanded = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(expanded["input_ids"][0]), processor.tokenizer(text)["input_ids"]


class ImageExpandingEngine:
    """Expands image placeholders as vLLM does: the first image token left for each image becomes as many tokens as
    the image processor makes of that image, resized with the `mm_processor_kwargs` the prompt carries (a prompt
    whose placeholders are already expanded keeps its surplus tokens, as in huggingface/trl#6294)."""

    def __init__(self, processor) -> None:
        self.processor, self.received = processor, []

    def image_tokens(self, image, mm_processor_kwargs: dict) -> int:
        processed = self.processor.image_processor(images=[image], return_tensors="pt", **mm_processor_kwargs)
        return int(processed["image_grid_thw"].prod()) // self.processor.image_processor.merge_size**2

    def generate(self, prompts, *args, **kwargs):
        self.received.extend(prompts)
        outputs = []
        for prompt in prompts:
            images = iter(prompt.get("multi_modal_data", {}).get("image", []))
            ids = []
            for token in prompt["prompt_token_ids"]:
                image = next(images, None) if token == self.processor.image_token_id else None
                ids += [token] * (
                    1 if image is None else self.image_tokens(image, prompt.get("mm_processor_kwargs", {}))
                )
            outputs.append(SimpleNamespace(prompt_token_ids=ids))
        params = kwargs.get("sampling_params")
        for index, output in enumerate(outputs):  # n samples per request, as vLLM returns them
            n = (params[index] if isinstance(params, list) else params).n if params is not None else 1
            output.outputs = [
                SimpleNamespace(request=len(self.received) - len(prompts) + index, sample=k) for k in range(n)
            ]
        return outputs

    def reset_prefix_cache(self) -> str:
        return "engine's own"


def test_collapsing_gives_the_template_prompt_vllm_expands_itself(rendered, processor) -> None:
    expanded, unexpanded = rendered
    assert expanded.count(processor.image_token_id) > 1
    assert collapse_image_runs(expanded, processor.image_token_id) == unexpanded


def test_collapsing_keeps_one_placeholder_per_image_and_every_other_token() -> None:
    assert collapse_image_runs([1, PAD, PAD, PAD, 2, PAD, PAD, 3], PAD) == [1, PAD, 2, PAD, 3]
    assert collapse_image_runs([1, 2, 3], PAD) == [1, 2, 3]


def two_image_prompt(processor) -> tuple[list[int], list]:
    """The trainer's expanded ids for a prompt with two images of different sizes (neither at the pixel cap)."""
    images = [Image.new("RGB", (150, 90), "red"), Image.new("RGB", (60, 100), "blue")]
    content = [
        {"type": "image", "image": images[0]},
        {"type": "text", "text": "and"},
        {"type": "image", "image": images[1]},
    ]
    messages = [{"role": "user", "content": content}]
    rendered = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    return list(rendered["input_ids"][0]), images


def test_the_engine_expands_prompts_to_the_trainers_ids_with_the_trainers_pixel_limits(processor) -> None:
    """The expansion is the engine's, from the images and the pixel limits the wrapper sends: not a count the test
    picks. The trainer's prompt through the wrapper comes back token for token."""
    expanded, images = two_image_prompt(processor)
    engine = VisionPromptEngine(ImageExpandingEngine(processor), processor.image_token_id, pixel_kwargs(processor))
    (output,) = engine.generate([{"prompt_token_ids": expanded, "multi_modal_data": {"image": images}}])
    assert output.prompt_token_ids == expanded
    assert engine.llm.received[0]["prompt_token_ids"].count(processor.image_token_id) == 2
    assert engine.reset_prefix_cache() == "engine's own"  # everything else is the engine's


@dataclass
class Sampling:
    """vLLM's SamplingParams as the wrapper uses it: `n` and `clone` (the real class runs in tests_vllm/)."""

    n: int = 1

    def clone(self) -> Sampling:
        return Sampling(self.n)


def test_only_runs_of_the_same_ids_and_pixels_count_as_copies() -> None:
    red, also_red, blue = (
        Image.new("RGB", (28, 28), "red"),
        Image.new("RGB", (28, 28), "red"),
        Image.new("RGB", (28, 28)),
    )
    prompts = [
        {"prompt_token_ids": [1, 2], "multi_modal_data": {"image": red}},
        {"prompt_token_ids": [1, 2], "multi_modal_data": {"image": also_red}},  # another object, the same pixels
        {"prompt_token_ids": [1, 2], "multi_modal_data": {"image": blue}},  # the same ids, other pixels
        {"prompt_token_ids": [1, 3], "multi_modal_data": {"image": blue}},
        {"prompt_token_ids": [1, 3]},  # no image
        {"prompt_token_ids": [1, 3]},
        {"prompt_token_ids": [1, 2], "multi_modal_data": {"image": red}},  # a copy, but not next to its first
    ]
    assert copy_groups(prompts) == [(0, 2), (2, 1), (3, 1), (4, 2), (6, 1)]


@pytest.mark.parametrize("share", [True, False])
def test_copies_reach_the_engine_once_with_n_and_come_back_one_per_copy(processor, share: bool) -> None:
    expanded, images = two_image_prompt(processor)
    other = [Image.new("RGB", image.size, "white") for image in images]
    prompts = [
        {"prompt_token_ids": expanded, "multi_modal_data": {"image": pixels}} for pixels in [images] * 3 + [other]
    ]
    engine = VisionPromptEngine(
        ImageExpandingEngine(processor), processor.image_token_id, pixel_kwargs(processor), share_copies=share
    )
    outputs = engine.generate(prompts, sampling_params=Sampling())
    requests = [(output.request, output.sample) for out in outputs for output in out.outputs]
    assert len(engine.llm.received) == (2 if share else 4)
    assert requests == ([(0, 0), (0, 1), (0, 2), (1, 0)] if share else [(0, 0), (1, 0), (2, 0), (3, 0)])
    assert all(output.prompt_token_ids == expanded for output in outputs)


def test_trls_expanded_prompt_or_other_pixel_limits_are_refused(processor) -> None:
    """What TRL 1.16 sends (the expanded ids, each image token expanded again), and an engine resizing with other
    pixel limits: the engine's prompt differs from the trainer's, and the check refuses both."""
    expanded, images = two_image_prompt(processor)
    fake = ImageExpandingEngine(processor)
    prompt = {"prompt_token_ids": expanded, "multi_modal_data": {"image": images}}
    (raw,) = fake.generate([prompt])
    with pytest.raises(PromptMismatchError, match="pixel limits"):
        check_engine_prompt(expanded, raw.prompt_token_ids, processor.image_token_id)
    smaller = {"size": {**processor.image_processor.size, "longest_edge": 28 * 28 * 4}}
    with pytest.raises(PromptMismatchError, match="pixel limits"):
        VisionPromptEngine(fake, processor.image_token_id, smaller).generate([prompt])


def _generation(mode: str, processor) -> VLLMGeneration:
    generation = object.__new__(VLLMGeneration)  # TRL's object without starting an engine
    generation.mode, generation.generation_kwargs, generation.processing_class = mode, {"seed": 1}, processor
    generation.llm = ImageExpandingEngine(processor)
    return generation


@pytest.mark.parametrize("mode", ["colocate", "server"])
def test_vllm_never_samples_a_vision_token(mode, processor) -> None:
    generation = VisionVLLMGeneration.of(_generation(mode, processor), processor)
    bias = generation.generation_kwargs["logit_bias"]
    assert set(bias) == set(vision_special_token_ids(processor.tokenizer)) and len(bias) >= 4
    assert set(bias.values()) == {NEVER}
    assert generation.generation_kwargs["seed"] == 1  # TRL's own settings kept
    assert isinstance(generation.llm, VisionPromptEngine) == (mode == "colocate")


def test_a_server_with_other_pixel_limits_is_refused(rendered, processor) -> None:
    expanded, _ = rendered
    generation = VisionVLLMGeneration.of(_generation("server", processor), processor)
    n = expanded.count(processor.image_token_id)
    same = {"mm_placeholders": {"image": [{"offset": 3, "length": n}]}}
    assert generation._place_features(same, expanded)["mm_placeholders"]["image"][0]["length"] == n
    other = {"mm_placeholders": {"image": [{"offset": 3, "length": n + 11}]}}
    with pytest.raises(PromptMismatchError, match="mm-processor-kwargs"):
        generation._place_features(other, expanded)


def _started(guard: LogprobGapGuard, model: torch.nn.Module | None = None, **sampling: float) -> LogprobGapGuard:
    """The guard after train start with TRL's sampling defaults (no truncation) or `sampling`'s."""
    settings = {"top_p": 1.0, "top_k": 0, "min_p": None, **sampling}
    args = SimpleNamespace(use_vllm=True, vllm_importance_sampling_correction=True, **settings)
    guard.on_train_begin(args, SimpleNamespace(global_step=0), None, model=model)
    return guard


def _log(guard: LogprobGapGuard, step: int, gap: float) -> None:
    guard.on_log(None, SimpleNamespace(global_step=step), None, logs={GAP_KEY: gap})


def test_the_guard_stops_a_wide_gap_on_the_first_steps_naming_the_causes() -> None:
    guard = _started(LogprobGapGuard(threshold=0.05, action="stop", steps=3))
    _log(guard, 1, 0.01)
    with pytest.raises(LogprobGapError) as error:
        _log(guard, 2, 0.10)
    for cause in ("prompt form", "pixel limits", "chat template", "weight sync", "logprob_gap_threshold 0.05"):
        assert cause in str(error.value)


def test_the_guard_lets_later_steps_drift_but_always_checks_the_first_gap() -> None:
    guard = _started(LogprobGapGuard(threshold=0.05, action="stop", steps=3))
    _log(guard, 1, 0.01)
    _log(guard, 10, 0.5)  # the policy moved: not checked
    assert guard.gaps == [(1, 0.01), (10, 0.5)]
    with pytest.raises(LogprobGapError):
        _log(_started(LogprobGapGuard(threshold=0.05, steps=3)), 20, 0.5)  # first logged gap, late (logging_steps 20)


class _Adapter(torch.nn.Module):
    """A model whose only parameter is named as PEFT names a LoRA B matrix."""

    def __init__(self, values: list[float]) -> None:
        super().__init__()
        self.lora_B = torch.nn.Parameter(torch.tensor(values))


def test_auto_stops_the_first_gap_over_the_threshold_as_the_trl_prompt_form_gives() -> None:
    """A fresh adapter (B = 0): the engine's first weights are the trainer's, so the replica's broken prompt form
    (0.098 through the CPU vLLM build, tests_vllm) stops the run at step 1 under the default action."""
    for model in (None, _Adapter([0.0, 0.0])):
        guard = _started(LogprobGapGuard(), model=model)
        assert guard.action == "auto"
        with pytest.raises(LogprobGapError, match="step 1: .* 0.0980"):
            _log(guard, 1, 0.098)


def test_auto_warns_while_rounding_can_explain_the_gap_and_logs_the_runs_baseline(caplog) -> None:
    """After the first step the merged bf16 weights and the float32 adapters may part: a healthy run whose gaps
    cross 0.08 on steps 2-5 only warns, then the guard logs the run's baseline."""
    guard = _started(LogprobGapGuard(steps=5))
    with caplog.at_level("INFO", logger="vision_grpo.training.logprob_guard"):
        for step, gap in enumerate([0.03, 0.09, 0.12, 0.10, 0.085, 0.5], start=1):
            _log(guard, step, gap)  # step 6 is past the checked steps
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert [r.getMessage().split(":")[0] for r in warnings] == ["step 2", "step 3", "step 4", "step 5"]
    assert "only a gap over 0.24 stops" in warnings[0].getMessage()
    assert "baseline of this run: median 0.0900, max 0.1200 over its first 5 logged steps" in caplog.text


def test_auto_warns_on_a_first_gap_logged_after_step_one(caplog) -> None:
    """`logging_steps` 20: the first logged gap averages steps the adapters had moved in, so it only warns."""
    with caplog.at_level("WARNING", logger="vision_grpo.training.logprob_guard"):
        _log(_started(LogprobGapGuard()), 20, 0.12)
    assert "step 20:" in caplog.text


def test_auto_still_stops_a_gap_far_over_any_healthy_one_after_the_first_step() -> None:
    guard = _started(LogprobGapGuard(steps=5))
    _log(guard, 1, 0.03)
    _log(guard, 2, 0.2)  # over 0.08, under 3 x 0.08: a warning
    with pytest.raises(LogprobGapError, match="step 3"):
        _log(guard, 3, 0.25)


@pytest.mark.parametrize(
    "model",
    [_Adapter([0.0, 0.01]), _Adapter([])],  # a warm-started adapter; one ZeRO-3 sharded away (unreadable)
    ids=["warm-started", "zero3-sharded"],
)
def test_auto_warns_on_the_first_gap_of_a_warm_started_adapter(model, caplog) -> None:
    guard = _started(LogprobGapGuard(), model=model)
    assert not guard.same_weights_at_start
    with caplog.at_level("WARNING", logger="vision_grpo.training.logprob_guard"):
        _log(guard, 1, 0.12)
    assert "step 1:" in caplog.text
    with pytest.raises(LogprobGapError):
        _log(guard, 2, 0.3)


def test_explicit_actions_keep_their_meaning(caplog) -> None:
    """`stop`: any checked step over the threshold stops, a warm start too; `warn`: nothing stops."""
    stop = _started(LogprobGapGuard(action="stop"), model=_Adapter([0.5]))
    _log(stop, 1, 0.03)
    with pytest.raises(LogprobGapError):
        _log(stop, 2, 0.09)
    warn = _started(LogprobGapGuard(action="warn"))
    with caplog.at_level("WARNING", logger="vision_grpo.training.logprob_guard"):
        _log(warn, 1, 5.0)
    assert "step 1:" in caplog.text and "only a gap over" not in caplog.text


@pytest.mark.parametrize("truncation", [{"top_p": 0.8}, {"top_k": 20}, {"min_p": 0.05}])
def test_with_truncated_sampling_the_guard_warns_naming_the_truncation(truncation, caplog) -> None:
    guard = _started(LogprobGapGuard(threshold=0.05), **truncation)
    with caplog.at_level("WARNING", logger="vision_grpo.training.logprob_guard"):
        _log(guard, 1, 0.11)
    ((key, value),) = truncation.items()
    assert f"{key}={value}" in caplog.text and "renormalised" in caplog.text and "top_p 1.0" in caplog.text


def test_the_guard_follows_its_recipe_keys(caplog) -> None:
    task_args = parse_recipe(
        (TaskArguments, GRPOConfig, ModelConfig),
        ["--config", "recipes/shapes/tiny_cpu.yaml", "--logprob_gap_threshold", "0.2", "--logprob_gap_action", "warn"],
    )[0]
    guard = _started(LogprobGapGuard.from_recipe(task_args))
    _log(guard, 1, 0.15)  # under the recipe's threshold: nothing
    assert not caplog.text
    with caplog.at_level("WARNING", logger="vision_grpo.training.logprob_guard"):
        _log(guard, 2, 0.3)  # over it, with `warn`: a warning, training goes on
    assert "logprob_gap_threshold 0.2" in caplog.text
    default = parse_recipe((TaskArguments, GRPOConfig, ModelConfig), ["--config", "recipes/shapes/tiny_cpu.yaml"])[0]
    assert LogprobGapGuard.from_recipe(default).action == "auto"
    with pytest.raises(RecipeError, match="logprob_gap_action"):
        parse_recipe(
            (TaskArguments, GRPOConfig, ModelConfig),
            ["--config", "recipes/shapes/tiny_cpu.yaml", "--logprob_gap_action", "halt"],
        )

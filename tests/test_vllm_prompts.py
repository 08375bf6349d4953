"""The vLLM fixes and the logprob-gap guard without a vLLM build (engine and server replaced by fakes that expand
image placeholders as vLLM does). The same code runs against a real CPU vLLM build in tests_vllm/."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from trl.generation.vllm_generation import VLLMGeneration

from vision_grpo.logprob_guard import GAP_KEY, LogprobGapError, LogprobGapGuard
from vision_grpo.modeling import vision_special_token_ids
from vision_grpo.processing import load_processor
from vision_grpo.vllm_generation import (
    NEVER,
    PromptMismatchError,
    VisionPromptEngine,
    VisionVLLMGeneration,
    check_engine_prompt,
    collapse_image_runs,
)

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


class FakeEngine:
    """Expands every image token of a prompt into `n` tokens, as vLLM does with the image it is given."""

    def __init__(self, image_token_id: int, n: int) -> None:
        self.image_token_id, self.n, self.received = image_token_id, n, []

    def generate(self, prompts, *args, **kwargs):
        self.received.extend(prompts)
        outputs = []
        for prompt in prompts:
            ids = [
                t
                for token in prompt["prompt_token_ids"]
                for t in ([token] * self.n if token == self.image_token_id else [token])
            ]
            outputs.append(SimpleNamespace(prompt_token_ids=ids))
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


def test_the_engine_gets_unexpanded_prompts_with_the_trainers_pixel_limits(rendered, processor) -> None:
    expanded, unexpanded = rendered
    n = expanded.count(processor.image_token_id)
    fake = FakeEngine(processor.image_token_id, n)
    engine = VisionPromptEngine(fake, processor.image_token_id, {"size": dict(processor.image_processor.size)})
    engine.generate([{"prompt_token_ids": expanded, "multi_modal_data": {"image": "img"}}])
    assert fake.received[0]["prompt_token_ids"] == unexpanded
    assert fake.received[0]["mm_processor_kwargs"] == {"size": processor.image_processor.size}
    assert engine.reset_prefix_cache() == "engine's own"  # everything else is the engine's


def test_trls_expanded_prompt_expanded_again_is_refused(rendered, processor) -> None:
    """What TRL 1.16 sends, through an engine that expands again: the engine-prompt check refuses it."""
    expanded, _ = rendered
    fake = FakeEngine(processor.image_token_id, expanded.count(processor.image_token_id))
    output = fake.generate([{"prompt_token_ids": expanded}])[0]
    with pytest.raises(PromptMismatchError, match="pixel limits"):
        check_engine_prompt(expanded, output.prompt_token_ids, processor.image_token_id)


def _generation(mode: str, processor) -> VLLMGeneration:
    generation = object.__new__(VLLMGeneration)  # TRL's object without starting an engine
    generation.mode, generation.generation_kwargs, generation.processing_class = mode, {"seed": 1}, processor
    generation.llm = FakeEngine(processor.image_token_id, 25)
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


def _log(guard: LogprobGapGuard, step: int, gap: float) -> None:
    args = SimpleNamespace(use_vllm=True, vllm_importance_sampling_correction=True)
    guard.on_log(args, SimpleNamespace(global_step=step), None, logs={GAP_KEY: gap})


def test_the_guard_stops_a_wide_gap_on_the_first_steps_naming_the_causes() -> None:
    guard = LogprobGapGuard(threshold=0.05, steps=3)
    _log(guard, 1, 0.01)
    with pytest.raises(LogprobGapError) as error:
        _log(guard, 2, 0.10)
    for cause in ("prompt form", "pixel limits", "chat template", "weight sync"):
        assert cause in str(error.value)


def test_the_guard_lets_later_steps_drift_but_always_checks_the_first_gap() -> None:
    guard = LogprobGapGuard(threshold=0.05, steps=3)
    _log(guard, 1, 0.01)
    _log(guard, 10, 0.5)  # the policy moved: not checked
    assert guard.gaps == [(1, 0.01), (10, 0.5)]
    with pytest.raises(LogprobGapError):
        _log(LogprobGapGuard(threshold=0.05, steps=3), 20, 0.5)  # first logged gap, late (logging_steps 20)

"""The Gated DeltaNet path is read with transformers' checks: absent kernels (as here) give the fallback."""

from __future__ import annotations

import importlib.util

import pytest

from vision_grpo.models import gated_deltanet
from vision_grpo.models.gated_deltanet import describe_gated_deltanet_path, gated_deltanet_path


def test_without_the_kernels_the_torch_fallback_is_named():
    if importlib.util.find_spec("fla") is not None:
        pytest.skip("flash-linear-attention is installed here")
    assert gated_deltanet_path() == "torch"
    assert "torch fallback" in describe_gated_deltanet_path("torch")


@pytest.mark.parametrize(("fla", "conv"), [(True, True), (True, False), (False, True)])
def test_both_kernels_are_needed(monkeypatch, fla, conv):
    # A mock: fla and causal-conv1d need CUDA, so their presence is simulated at transformers' checks.
    monkeypatch.setattr(gated_deltanet, "is_flash_linear_attention_available", lambda: fla)
    monkeypatch.setattr(gated_deltanet, "is_causal_conv1d_available", lambda: conv)
    assert gated_deltanet_path() == ("kernels" if fla and conv else "torch")


def test_loading_a_qwen3_5_model_logs_the_path(caplog):
    from trl import ModelConfig

    from vision_grpo.models.loading import load_model

    with caplog.at_level("INFO", logger="vision_grpo.models.loading"):
        load_model(ModelConfig(model_name_or_path="vision-grpo/tiny-qwen3.5", dtype="float32"))
    assert describe_gated_deltanet_path(gated_deltanet_path()) in caplog.messages


@pytest.mark.parametrize("model", ["vision-grpo/tiny-qwen3.5", "vision-grpo/tiny-qwen2.5-vl"])
def test_an_old_flash_linear_attention_is_refused_for_gated_deltanet_models_only(monkeypatch, model):
    # fla cannot be installed here (it needs triton and CUDA): the installed version is given at the one place that
    # reads it, and the refusal (or not) is this project's own decision on it.
    from trl import ModelConfig

    from vision_grpo.models.loading import load_model

    old = {gated_deltanet.FLA: "0.4.2"}
    monkeypatch.setattr(gated_deltanet, "installed_version", old.get)
    model_args = ModelConfig(model_name_or_path=model, dtype="float32")
    if model.endswith("qwen3.5"):
        with pytest.raises(RuntimeError, match=r"tiny-qwen3.5: flash-linear-attention 0.4.2 is installed: .* pip"):
            load_model(model_args)
    else:
        assert load_model(model_args).config.model_type == "qwen2_5_vl"  # no Gated DeltaNet layers: no refusal


@pytest.mark.parametrize(("installed", "refused"), [(None, False), ("0.4.2", True), ("0.5.0", False), ("0.5.2", False)])
def test_versions_from_0_5_read_grouped_value_heads(monkeypatch, installed, refused):
    monkeypatch.setattr(gated_deltanet, "installed_version", lambda name: installed)
    assert (gated_deltanet.old_fla_message() is not None) == refused

"""The memory plan of Qwen3.5's Gated DeltaNet layers on the kernel path (flash-linear-attention + causal-conv1d).

Those kernels need CUDA, so they cannot run here. Instead transformers' own Qwen3.5 mixer runs on fake tensors with
the two kernel calls replaced by stand-ins that allocate, free and save for backward exactly what the kernels' code
does (flash-linear-attention 0.5.2 at bc3b101, fla/ops/gated_delta_rule/chunk.py and the functions it calls;
causal-conv1d at 0d2252d, causal_conv1d/causal_conv1d_interface.py): the plan's closed-form kernel terms must equal
that hand count, for the real width and for a small config whose key and value widths differ. Then: the kernel path
is smaller than the torch fallback at the sizes the GeoQA recipe runs, and the plan counts the detected path (or the
forced one) and names it.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_plan import REPO, _recipe
from transformers.models.qwen3_5 import modeling_qwen3_5

from vision_grpo.models.gated_deltanet import gated_deltanet_path
from vision_grpo.plan import check as plan_check
from vision_grpo.plan import estimate as plan_build
from vision_grpo.plan import formulas as mf
from vision_grpo.plan import plan_command as plan_cli

GEOQA = ["--config", "recipes/geoqa/qwen3_5_4b_lora.yaml"]


class _CausalConv1d(torch.autograd.Function):
    """causal_conv1d_interface.py's `CausalConv1dFn`: a channel-last input is used as it is, the output is allocated
    like it (`at::empty_like(x)` in the extension), and x, weight and bias are saved (SiLU is recomputed)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.stride(2) != 1 and x.stride(1) != 1:
            x = x.contiguous()
        ctx.save_for_backward(x, weight, bias)
        return torch.empty_like(x)


def causal_conv1d_fn(x, weight, bias=None, activation=None, **kwargs) -> torch.Tensor:
    return _CausalConv1d.apply(x, weight, bias)


def _l2norm_fwd(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fla/modules/l2norm.py `l2norm_fwd`: an output like x and one float32 reciprocal norm per row."""
    rows = x.view(-1, x.shape[-1])
    return torch.empty_like(rows).view(x.shape), torch.empty(rows.shape[0], dtype=torch.float32)


def _chunk_fwd(k, v, beta, output_final_state: bool, chunk: int = 64):
    """fla/ops/gated_delta_rule/chunk.py `chunk_gated_delta_rule_fwd` with chunk_size 64: what it allocates, in order;
    w, u, h and v_new die when it returns."""
    (b, t, _, key_dim), (heads, value_dim) = k.shape, v.shape[2:]
    g = torch.empty(b, t, heads, dtype=torch.float32)  # chunk_local_cumsum(output_dtype=torch.float)
    a = torch.zeros(b, t, heads, chunk, dtype=k.dtype)  # chunk_gated_delta_rule_fwd_intra: the fused kkt + solve
    w, u = k.new_empty(b, t, heads, key_dim), torch.empty_like(v)  # recompute_w_u_fwd
    chunks = -(-t // chunk)
    h = k.new_empty(b, chunks, heads, key_dim, value_dim)  # chunk_gated_delta_rule_fwd_h: the state of every chunk
    final = k.new_zeros(b, heads, key_dim, value_dim, dtype=torch.float32) if output_final_state else None
    v_new = torch.empty_like(u)
    o = torch.empty_like(v_new)  # chunk_fwd_o
    del w, u, h, v_new
    return g, o, a, final


class _ChunkGatedDeltaRule(torch.autograd.Function):
    """`ChunkGatedDeltaRuleFunction.forward` with use_qk_l2norm_in_kernel: `input_guard` makes every input
    contiguous (copies of the q, k, v views, alive until it returns), q and k are l2-normed, and q, q_rstd, k,
    k_rstd, v, g, beta_raw, beta and A are saved."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, output_final_state: bool):
        guarded = [x.contiguous() for x in (q, k, v, g, beta)]  # input_guard's list holds them through the call
        q, k, v, g, beta = guarded
        q, q_rstd = _l2norm_fwd(q)
        k, k_rstd = _l2norm_fwd(k)
        g, o, a, final = _chunk_fwd(k, v, beta, output_final_state)
        ctx.save_for_backward(q, q_rstd, k, k_rstd, v, g, beta, beta, a)
        return o, final


def chunk_gated_delta_rule(query, key, value, g, beta, initial_state=None, output_final_state=False, **kwargs):
    assert initial_state is None and kwargs["use_qk_l2norm_in_kernel"]
    return _ChunkGatedDeltaRule.apply(query, key, value, g, beta, output_final_state)


@pytest.fixture
def kernel_stand_ins(monkeypatch) -> None:
    monkeypatch.setattr(modeling_qwen3_5, "causal_conv1d_fn", causal_conv1d_fn)
    monkeypatch.setattr(modeling_qwen3_5, "torch_chunk_gated_delta_rule", chunk_gated_delta_rule)


def _qwen3_5_4b() -> mf.ModelShape:
    return mf.shape_of(plan_build.model_config("Qwen/Qwen3.5-4B"))


def _small() -> mf.ModelShape:
    """Key and value heads, and key and value head widths, all different: a term on the wrong width shows."""
    return dataclasses.replace(
        _qwen3_5_4b(), hidden=96, linear_key_heads=2, linear_value_heads=6, linear_key_dim=32, linear_value_dim=48
    )


# The fake-tensor counts behind the torch path's terms, uncached: run here with the stand-ins in place
kept_per_token = mf.gated_delta_net_bytes_per_token.__wrapped__
prefill_peak = mf.gated_delta_net_prefill_bytes.__wrapped__


@pytest.mark.parametrize("shape", [_qwen3_5_4b(), _small()], ids=["qwen3.5-4b", "small"])
@pytest.mark.parametrize("tokens", [192, 1217])
def test_the_kernel_terms_equal_the_stand_in_count(shape, tokens, kernel_stand_ins) -> None:
    """Kept for backward per token, and the prefill's peak, at a whole number of chunks and at a partial last one.
    The count also holds one tensor per sequence, not per token, that the formula leaves out: the gate's float32
    -exp(A_log), one per value head, which its multiplication saves."""
    per_sequence = mf.FP32 * shape.linear_value_heads
    kept = round(kept_per_token(shape, tokens) * tokens)
    assert kept == mf.gated_delta_net_kernel_bytes_per_token(shape) * tokens + per_sequence
    assert prefill_peak(shape, tokens) == mf.gated_delta_net_kernel_prefill_bytes(shape, tokens)


def test_the_kernel_path_grows_linearly_in_tokens(kernel_stand_ins) -> None:
    """No per-chunk matrix grows with the prompt beyond one state per 64 tokens: doubling a prompt of whole chunks
    doubles the prefill's peak, and what is kept grows by the same bytes per token at every length."""
    shape = _qwen3_5_4b()
    assert prefill_peak(shape, 2048) == 2 * prefill_peak(shape, 1024)
    kept = {t: round(kept_per_token(shape, t) * t) for t in (512, 1024, 2048)}
    assert kept[2048] - kept[1024] == 2 * (kept[1024] - kept[512])


def test_the_kernel_path_is_smaller_than_the_torch_fallback_at_the_geoqa_sizes() -> None:
    shape = _qwen3_5_4b()
    kernel, torch_ = mf.gated_delta_net_kernel_bytes_per_token(shape), mf.gated_delta_net_bytes_per_token(shape)
    assert kernel < 0.5 * torch_, (kernel, torch_)
    for prompt in (300, 1217):  # a 256-px and a 1-MP image with 256 text tokens
        kernel, torch_ = (
            mf.gated_delta_net_kernel_prefill_bytes(shape, prompt),
            mf.gated_delta_net_prefill_bytes(shape, prompt),
        )
        assert kernel < 0.7 * torch_, (prompt, kernel, torch_)


def _plan_output(capsys, *flags: str) -> str:
    assert plan_cli.main([*GEOQA, *flags]) == 0
    return capsys.readouterr().out


def _peak(out: str) -> float:
    line = next(line for line in out.splitlines() if line.strip().startswith("peak ("))
    return float(line.split("GiB")[0].split()[-1])


def test_the_plan_names_the_path_it_counted_and_can_be_forced(capsys, monkeypatch) -> None:
    monkeypatch.chdir(REPO)
    detected = _plan_output(capsys)
    assert f"Gated DeltaNet layers: {gated_deltanet_path()} (detected here)" in detected.splitlines()[0]
    kernels, fallback = _plan_output(capsys, "--gated_deltanet_path", "kernels"), _plan_output(capsys)
    assert "Gated DeltaNet layers: kernels (--gated_deltanet_path)" in kernels.splitlines()[0]
    assert _peak(kernels) < _peak(_plan_output(capsys, "--gated_deltanet_path", "torch"))
    assert _peak(fallback) == _peak(detected)
    # a model without Gated DeltaNet layers says nothing of them
    assert "Gated DeltaNet" not in _plan_output(capsys, "--model_name_or_path", "Qwen/Qwen3-VL-4B-Instruct")


def test_the_training_check_plans_the_path_this_machine_runs(monkeypatch) -> None:
    """check_before_training (recipes/train.py) on a machine where the kernels are usable (its detection faked: they
    need CUDA) plans the kernel path, and the fallback where they are not."""
    monkeypatch.chdir(REPO)
    plans = {}
    for path in ("kernels", "torch"):
        monkeypatch.setattr(plan_build, "gated_deltanet_path", lambda path=path: path)
        plans[path] = plan_check.check_before_training(*_recipe("recipes/geoqa/qwen3_5_4b_lora.yaml"))
        assert f"Gated DeltaNet layers: {path} (detected here)" in plans[path].sizes
    assert plans["kernels"].total() < plans["torch"].total()

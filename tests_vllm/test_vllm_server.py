"""TRL's server mode against a real vLLM server on CPU, up to the weight transfer (issue 39, item 4).

One server per module, started with the command `trl vllm-serve` builds (tests_vllm/trl_vllm_serve.py says what
differs on CPU: only how vLLM's CLI module is started), in float32, with the recipe's pixel limits passed as vLLM's
`--mm-processor-kwargs`, as docs/scaling.md tells users to start it. What cannot run here: TRL's weight transfer.
`VLLMClient.init_communicator` raises `NotImplementedError` for a non-CUDA device, and `update_named_params`
broadcasts over the NCCL group it would open, so a GRPO run in server mode stops while the trainer is built; the
tests check that stop, then (tests_vllm/server_probe.py) let one GRPO step run without it, since before the first
step the policy is the checkpoint the server loaded, and check what crossed the wire.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import RECIPE, REPO, check, run_python

# The recipe's pixel limits for these tests: they make the processor upscale the shapes images (other than the
# replica's defaults), so a server started without them makes other image-token counts.
MIN_PIXELS, MAX_PIXELS = 40000, 50176
SERVER_PIXELS = {"size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}}
RECIPE_PIXELS = ["--min_pixels", str(MIN_PIXELS), "--max_pixels", str(MAX_PIXELS)]
BATCH, G = 8, 4  # the recipe's per_device_train_batch_size and num_generations: 2 prompts x 4 completions
# Float32 server vs the float32 trainer-side policy, both from the replica's weights: per-token logprobs agree within
# this bound; a wrong prompt, image or position moves them far more.
TOLERANCE = 1e-4
START_TIMEOUT = 600  # seconds; a start takes 40-90 s on the 2-core machine, longer beside another test module


@dataclass
class Server:
    url: str
    log: Path
    process: subprocess.Popen


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


def stop(process: subprocess.Popen) -> None:
    """The server and everything it started (its own session): SIGTERM, then SIGKILL after 30 s."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
    with contextlib.suppress(ProcessLookupError):  # anything left in its group (none expected: one process here)
        os.killpg(process.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def server(replica, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("vllm_server") / "server.log"
    command = [sys.executable, "tests_vllm/trl_vllm_serve.py", "--model", str(replica), "--host", "127.0.0.1"]
    command += ["--port", str(port), "--dtype", "float32", "--max_model_len", "512"]
    command += ["--mm-processor-kwargs", json.dumps(SERVER_PIXELS)]  # a vLLM flag, passed on by TRL as-is
    with log.open("w") as sink:
        process = subprocess.Popen(
            command, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT, env=dict(os.environ), start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while not healthy(url):
            if process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"the vLLM server did not come up ({process.poll()}):\n{log.read_text()[-6000:]}")
            time.sleep(2)
        yield Server(url, log, process)
    finally:
        stop(process)


def test_the_server_runs_trls_command_with_one_change(server, replica) -> None:
    from trl_vllm_serve import cpu_command, trl_command

    args = ["--model", str(replica), "--port", "8000", "--dtype", "float32"]
    trl, ours = trl_command(args), cpu_command(trl_command(args))
    assert trl[1:3] == ["-m", "vllm.entrypoints.cli.main"]
    assert ours[1:3] == [str(REPO / "tests_vllm" / "trl_vllm_serve.py"), "--vllm-cli"]
    assert ours[3:] == trl[3:]  # every flag TRL builds, in its order
    assert '--weight-transfer-config {"backend": "nccl"}' in " ".join(trl)
    first = server.log.read_text().splitlines()[0]
    assert first.startswith("trl vllm-serve on CPU:") and "--vllm-cli serve" in first, first


# TRL's client imports vLLM in this process; vLLM's import warns (torch.jit.script_method, ...), which the project's
# pytest settings turn into errors. Entry points run in their own processes everywhere else in tests_vllm/.
@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")
def test_the_real_server_has_trls_settings_and_refuses_a_cpu_weight_transfer(server) -> None:
    """TRL's own client against the server: its settings are TRL's (NCCL weight transfer, processed logprobs) and
    the recipe's pixel limits; `init_communicator` on the trainer's CPU device stops before any rendezvous."""
    from trl.generation.vllm_client import VLLMClient

    client = VLLMClient(base_url=server.url, connection_timeout=10)
    info = client.get_server_info()
    assert info["weight_transfer_config"] == {"backend": "nccl"}
    model = info["model_config"]
    settings = (model["dtype"], model["logprobs_mode"], model["max_logprobs"])
    assert settings == ("torch.float32", "processed_logprobs", -1), settings
    assert model["multimodal_config"]["mm_processor_kwargs"] == SERVER_PIXELS, model["multimodal_config"]
    assert client.get_world_size() == 1
    with pytest.raises(NotImplementedError, match="needs a CUDA device, got 'cpu'"):
        client.init_communicator(device="cpu")
    assert client.communicator is None


def train(server: Server, out: Path, *keys: str, probe: bool = True) -> subprocess.CompletedProcess:
    """recipes/train.py in server mode against `server`, one step, under server_probe.py (or as is)."""
    args = ["recipes/train.py", "--config", RECIPE, "--vllm_mode", "server", "--vllm_server_base_url", server.url]
    args += ["--vllm_server_timeout", "30", "--max_steps", "1", "--save_strategy", "no", "--output_dir", str(out)]
    args += ["--per_device_train_batch_size", str(BATCH), "--num_generations", str(G), *keys]
    return run_python(["tests_vllm/server_probe.py", str(out / "probe.json"), *args] if probe else args)


def test_a_server_mode_grpo_run_stops_at_trls_weight_transfer_setup(server, tmp_path) -> None:
    """The unchanged run: the trainer reaches the real server, then TRL's `init_communicator` stops it on CPU."""
    process = train(server, tmp_path, *RECIPE_PIXELS, probe=False)
    assert process.returncode != 0
    assert "NotImplementedError" in process.stderr and "needs a CUDA device" in process.stderr, process.stderr[-3000:]


@pytest.fixture(scope="module")
def step(server, tmp_path_factory) -> dict:
    """One GRPO step of the recipe through the real server (server_probe.py's record)."""
    out = tmp_path_factory.mktemp("server_step")
    check(train(server, out, *RECIPE_PIXELS))
    return json.loads((out / "probe.json").read_text())


def image_runs(ids: list[int], image_token_id: int) -> list[int]:
    runs, length = [], 0
    for token in [*ids, None]:
        if token == image_token_id:
            length += 1
        elif length:
            runs, length = [*runs, length], 0
    return runs


def test_one_grpo_step_through_the_real_server_up_to_the_transfer(step) -> None:
    assert step["init_communicator"]["device"] == "cpu"
    assert "needs a CUDA device" in step["init_communicator"]["error"]
    assert step["syncs"] == [{"skipped": True, "lora_B_tensors": step["syncs"][0]["lora_B_tensors"], "all_zero": True}]
    (generation,) = step["generations"]
    assert generation["num_generations"] == G and len(generation["prompts"]) == BATCH
    logged = [log for log in step["logs"] if "sampling/sampling_logp_difference/mean" in log]
    assert len(logged) == 1 and any("train_runtime" in log for log in step["logs"]), step["logs"]


def test_each_prompt_reaches_the_server_once_with_n_g_as_the_trainer_built_it(step) -> None:
    """Token for token: the ids the server generated from are the trainer's (the prompt's G copies sent once, with
    n = G), its image features sit on the trainer's image-token runs, and G completions come back per prompt."""
    (generation,) = step["generations"]
    prompts, token = generation["prompts"], generation["image_token_id"]
    unique = prompts[::G]
    assert all(prompts[i] == unique[i // G] for i in range(BATCH))  # TRL's copies are consecutive
    assert [request["token_ids"] for request in step["requests"]] == unique
    assert [request["n"] for request in step["requests"]] == [G] * len(unique)
    assert [request["choices"] for request in step["requests"]] == [G] * len(unique)
    assert step["renders"] == len(unique)  # the images, once per prompt
    for request, ids in zip(step["requests"], unique, strict=True):
        runs = image_runs(ids, token)
        assert runs and [place["length"] for place in request["placeholders"]["image"]] == runs
        assert set(request["logit_bias"].values()) == {-100}  # the vision-token bias reached the server
    assert generation["prompt_ids"] == prompts
    assert len(generation["completion_ids"]) == BATCH and all(generation["completion_ids"])


def test_the_servers_logprobs_are_the_trainer_policys(step) -> None:
    """Each sampled token's server logprob (float32 engine, processed: with the vision-token bias) equals the
    trainer-side policy's log-probability of it under the same bias, from the same replica weights."""
    (generation,) = step["generations"]
    gaps = [
        abs(server - policy)
        for served, scored in zip(generation["logprobs"], generation["policy"], strict=True)
        for server, policy in zip(served, scored["biased"], strict=True)
    ]
    assert len(gaps) == sum(map(len, generation["completion_ids"]))
    print(f"server vs policy: {len(gaps)} tokens, largest |difference| {max(gaps):.3g}")
    assert max(gaps) < TOLERANCE, max(gaps)


def test_a_trainer_with_other_pixel_limits_than_the_server_is_refused(server, tmp_path) -> None:
    """The replica's own pixel limits in the trainer, the recipe's in the server: the server makes more image
    tokens than the trainer's prompt holds, and VisionVLLMGeneration._place_features refuses the first batch."""
    process = train(server, tmp_path)
    assert process.returncode != 0
    assert "PromptMismatchError" in process.stderr and "image tokens of the images" in process.stderr, process.stderr[
        -3000:
    ]
    record = json.loads((tmp_path / "probe.json").read_text())
    assert record["generations"] == [] and record["requests"] == []  # refused before any generation request

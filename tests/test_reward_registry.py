"""Reward plugins: a file dropped into a reward folder is found by name, and every way a plugin can go wrong fails
with a message that names the plugin (or its file) instead of failing somewhere inside TRL.

The registry is process-wide, so every plugin written here gets a unique name.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import signal
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import run_script

from vision_grpo.plugins.reward_calls import StopRequested
from vision_grpo.rewards import BUILTIN_DIR, RewardPluginError, get_reward_funcs
from vision_grpo.run import stopping
from vision_grpo.run.stopping import GracefulStop

COMPLETIONS = [[{"role": "assistant", "content": "2"}], [{"role": "assistant", "content": "a longer answer"}]]


def unique(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:10]}"


def write_plugin(folder: Path, body: str, stem: str | None = None) -> Path:
    path = folder / f"{stem or unique('plugin')}.py"
    path.write_text("from vision_grpo.rewards import completion_texts, reward\n\n" + textwrap.dedent(body))
    return path


def plugin_returning(folder: Path, expression: str) -> tuple[str, Path]:
    """A plugin whose reward returns `expression` (evaluated with `completions` and numpy as `np` in scope)."""
    name = unique("returns")
    body = f"import numpy as np\n\n\n@reward()\ndef {name}(completions, **kwargs):\n    return {expression}\n"
    return name, write_plugin(folder, body)


def test_a_plugin_in_an_extra_folder_is_found_and_usable_by_name(tmp_path: Path) -> None:
    name = unique("length")
    write_plugin(
        tmp_path,
        f"""
        @reward()
        def {name}(completions, eos_token_ids=None, **kwargs):
            return [len(text) + eos_token_ids[0] for text in completion_texts(completions)]
        """,
    )
    (func,) = get_reward_funcs([name], extra_dirs=[tmp_path], context={"eos_token_ids": [100], "unused": 1})
    assert func(completions=COMPLETIONS) == [101.0, 115.0]
    assert func.__name__ == name  # TRL logs rewards/<__name__>/mean


def test_rewards_keep_the_requested_order(tmp_path: Path) -> None:
    first, _ = plugin_returning(tmp_path, "[1.0] * len(completions)")
    second, _ = plugin_returning(tmp_path, "[2.0] * len(completions)")
    funcs = get_reward_funcs([second, "count_correct", first], extra_dirs=[tmp_path])
    assert [f.__name__ for f in funcs] == [second, "count_correct", first]


def test_an_unknown_name_lists_the_available_rewards() -> None:
    with pytest.raises(RewardPluginError, match="count_correct") as error:
        get_reward_funcs(["count_corect"])
    assert "count_corect" in str(error.value)
    assert "seed_count_reasoning" in str(error.value)


def test_two_plugins_with_one_name_name_both_files(tmp_path: Path) -> None:
    name = unique("twice")
    body = f"@reward()\ndef {name}(completions, **kwargs):\n    return [0.0] * len(completions)\n"
    first = write_plugin(tmp_path, body, stem="a_first")
    second = write_plugin(tmp_path, body, stem="b_second")
    with pytest.raises(RewardPluginError, match=name) as error:
        get_reward_funcs([name], extra_dirs=[tmp_path])
    assert str(first.resolve()) in str(error.value)
    assert str(second.resolve()) in str(error.value)


@pytest.mark.parametrize(
    ("expression", "complaint"),
    [
        ("[1.0]", "returned 1 values for 2 completions"),
        ("1.0", "returned float values"),
        ("[float('nan')] * len(completions)", "finite"),
        ("[float('inf'), 0.0]", "finite"),
        ("['1.0'] * len(completions)", "must be numbers"),
        ("[True, False]", "must be numbers"),
    ],
)
def test_a_bad_return_value_names_the_plugin(tmp_path: Path, expression: str, complaint: str) -> None:
    name, path = plugin_returning(tmp_path, expression)
    (func,) = get_reward_funcs([name], extra_dirs=[tmp_path])
    with pytest.raises(RewardPluginError, match=complaint) as error:
        func(completions=COMPLETIONS)
    assert name in str(error.value) and str(path.resolve()) in str(error.value)


def test_none_and_numpy_numbers_are_valid_rewards(tmp_path: Path) -> None:
    name, _ = plugin_returning(tmp_path, "[None, np.float32(0.5)]")
    other, _ = plugin_returning(tmp_path, "[1.0, None]")  # None: "not mine", where another reward scores it
    func, other_func = get_reward_funcs([name, other], extra_dirs=[tmp_path])
    values = func(completions=COMPLETIONS)
    assert values == [None, 0.5]
    assert type(values[1]) is float
    assert other_func(completions=COMPLETIONS) == [1.0, None]


def test_a_completion_no_reward_scores_is_an_error_naming_the_rewards_and_rows(tmp_path: Path) -> None:
    """Before: TRL summed the NaNs as reward 0; a reward returning None everywhere trained nothing, exit 0."""
    some, some_path = plugin_returning(tmp_path, "[None, 1.0, None]")
    none, none_path = plugin_returning(tmp_path, "[None] * len(completions)")
    completions = [*COMPLETIONS, COMPLETIONS[0]]
    ids = ["row-a", "row-b", "row-c"]
    first, second = get_reward_funcs([some, none], extra_dirs=[tmp_path])
    assert first(completions=completions, id=ids) == [None, 1.0, None]
    with pytest.raises(
        RewardPluginError, match=r"no reward scored 2 of 3 completions \(rows id=row-a, row-c\)"
    ) as error:
        second(completions=completions, id=ids)
    assert f"`{some}` ({some_path.resolve()})" in str(error.value)
    assert f"`{none}` ({none_path.resolve()})" in str(error.value)
    (alone,) = get_reward_funcs([none], extra_dirs=[tmp_path])
    with pytest.raises(RewardPluginError, match=r"no reward scored 2 of 2 completions \(rows id=#0, #1\)"):
        alone(completions=COMPLETIONS)


def test_a_plugin_that_raises_names_the_plugin_and_file(tmp_path: Path) -> None:
    name, path = plugin_returning(tmp_path, "1 / 0")
    (func,) = get_reward_funcs([name], extra_dirs=[tmp_path])
    with pytest.raises(RewardPluginError, match="ZeroDivisionError") as error:
        func(completions=COMPLETIONS)
    assert name in str(error.value) and str(path.resolve()) in str(error.value)


@pytest.mark.parametrize(
    "source", ["def broken(:\n", "import a_module_that_does_not_exist_anywhere\n", "raise RuntimeError('boom')\n"]
)
def test_a_plugin_that_fails_to_import_names_the_file(
    tmp_path: Path, source: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A run that asks for a reward the broken file might define is refused naming the file; a run that does not
    use it goes on, with a warning naming it (before: one broken file stopped every run)."""
    path = tmp_path / f"{unique('broken')}.py"
    path.write_text(source)
    with pytest.raises(
        RewardPluginError, match=r"unknown reward\(s\) \['its_reward'\], and 1 plugin file\(s\) failed"
    ) as error:
        get_reward_funcs(["its_reward"], extra_dirs=[tmp_path])
    assert f"{path.resolve()} failed to import" in str(error.value)
    with caplog.at_level(logging.WARNING):
        (func,) = get_reward_funcs(["count_correct"], extra_dirs=[tmp_path])
    assert f"{path.resolve()} failed to import" in caplog.text and "this run does not use it" in caplog.text


def test_a_reward_folder_anyone_can_write_to_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "shared"
    folder.mkdir()
    name, path = plugin_returning(folder, "[1.0] * len(completions)")
    folder.chmod(0o777)
    with pytest.raises(RewardPluginError, match=rf"reward folder {folder} is writable by every user: .*chmod o-w"):
        get_reward_funcs([name], extra_dirs=[folder])
    folder.chmod(0o755)
    path.chmod(0o666)
    with pytest.raises(RewardPluginError, match=rf"reward file {path.resolve()} is writable by every user"):
        get_reward_funcs([name], extra_dirs=[folder])


@pytest.mark.parametrize(
    ("statement", "said"),
    [
        ("sys.exit(0)", "called sys.exit(0)"),
        ("raise SystemExit('done')", "called sys.exit('done')"),
        ("raise KeyboardInterrupt", "raised KeyboardInterrupt"),
    ],
)
def test_a_plugin_that_tries_to_end_the_run_is_an_error_naming_it(tmp_path: Path, statement: str, said: str) -> None:
    name = unique("exits")
    path = write_plugin(tmp_path, f"import sys\n\n\n@reward()\ndef {name}(completions, **kwargs):\n    {statement}\n")
    (func,) = get_reward_funcs([name], extra_dirs=[tmp_path])
    with pytest.raises(RewardPluginError, match=re.escape(said)) as error:
        func(completions=COMPLETIONS)
    assert name in str(error.value) and str(path.resolve()) in str(error.value)


@pytest.mark.parametrize(
    "source", ["import sys\nsys.exit(0)\n", "import argparse\nargparse.ArgumentParser().parse_args()\n"]
)
def test_a_plugin_that_exits_while_imported_is_an_error_naming_the_file(
    tmp_path: Path, source: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("sys.argv", ["train.py", "--config", "recipe.yaml"])  # what argparse sees under an entry point
    path = tmp_path / f"{unique('exits_on_import')}.py"
    path.write_text(source)
    with pytest.raises(RewardPluginError, match=r"called sys\.exit\((0|2)\).*while being imported") as error:
        get_reward_funcs(["its_reward"], extra_dirs=[tmp_path])  # a reward the file might have defined
    assert str(path.resolve()) in str(error.value)


def test_a_missing_reward_folder_fails_clearly(tmp_path: Path) -> None:
    with pytest.raises(RewardPluginError, match="does not exist"):
        get_reward_funcs(["count_correct"], extra_dirs=[tmp_path / "nowhere"])


@pytest.fixture
def builtin_plugin_name() -> Iterator[str]:
    """A name for a plugin file in the real rewards/ folder; the file (and its bytecode) is removed afterwards."""
    name = unique("zz_dropped_in")
    path = BUILTIN_DIR / f"{name}.py"
    try:
        yield name
    finally:
        path.unlink(missing_ok=True)
        Path(importlib.util.cache_from_source(str(path))).unlink(missing_ok=True)


def test_a_file_dropped_into_the_rewards_folder_needs_no_other_edit(builtin_plugin_name: str) -> None:
    name = builtin_plugin_name
    get_reward_funcs(["count_correct"])  # plugins were discovered before the file appeared
    body = f"@reward()\ndef {name}(completions, **kwargs):\n    return [0.25] * len(completions)\n"
    write_plugin(BUILTIN_DIR, body, stem=name)
    (func,) = get_reward_funcs([name])
    assert func(completions=COMPLETIONS) == [0.25, 0.25]


def test_importing_the_folders_from_the_repository_root_shares_one_registry(tmp_path: Path) -> None:
    """`import rewards` (a script run from the repository root) and `vision_grpo.rewards` are one registry."""
    code = (
        "import sys; sys.path.insert(0, '.'); import rewards, data, vision_grpo.rewards, vision_grpo.plugins.tasks\n"
        "from rewards import reward\n"
        "@reward()\ndef from_the_root(completions, **kwargs): return [1.0] * len(completions)\n"
        "assert 'from_the_root' in vision_grpo.rewards.discover(), 'two registries'\n"
        "assert rewards.RewardPluginError is vision_grpo.rewards.RewardPluginError\n"
        "assert 'shapes' in vision_grpo.plugins.tasks.discover()\n"
        "print('one registry')"
    )
    script = tmp_path / "one_registry.py"
    script.write_text(code)
    process = run_script([str(script)], timeout=120)  # a process of its own: none of our modules imported yet
    assert "one registry" in process.stdout


def test_a_reward_cannot_change_what_the_rewards_after_it_read(tmp_path: Path) -> None:
    """TRL hands every reward the same completion and column objects: a weight-0 logger that edits them in place
    made the next reward score the edited text (the issue's `seed_count_correct` read 1.0 instead of 0.125)."""
    editor, reader = unique("edits"), unique("reads")
    write_plugin(
        tmp_path,
        f"""
        @reward()
        def {editor}(completions, answer, **kwargs):
            for completion in completions:
                completion[0]["content"] = "rewritten"
            answer[0] = "rewritten"
            completions.append([{{"role": "assistant", "content": "extra"}}])
            return [0.0] * (len(completions) - 1)

        @reward()
        def {reader}(completions, answer, **kwargs):
            return [float(text == gold) for text, gold in zip(completion_texts(completions), answer)]
        """,
    )
    edits, reads = get_reward_funcs([editor, reader], extra_dirs=[tmp_path])
    completions = [[{"role": "assistant", "content": "2"}], [{"role": "assistant", "content": "3"}]]
    answers = ["2", "5"]
    assert edits(completions=completions, answer=answers) == [0.0, 0.0]
    assert reads(completions=completions, answer=answers) == [1.0, 0.0]
    assert completions[0][0]["content"] == "2" and answers == ["2", "5"] and len(completions) == 2


@pytest.fixture
def graceful_stop_installed() -> Iterator[GracefulStop]:
    """The run's signal handlers, as a training installs them, restored afterwards."""
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    stop = GracefulStop(accelerator=None)  # the signal path needs no accelerator
    stop.on_train_begin(None, None, None)
    try:
        yield stop
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def test_a_reward_that_never_returns_is_stopped_once_the_first_sigterms_grace_is_over(
    tmp_path: Path, graceful_stop_installed: GracefulStop, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(stopping, "REWARD_STOP_GRACE_S", 0.5)
    name = unique("hangs")
    write_plugin(
        tmp_path,
        f"import time\n\n\n@reward()\ndef {name}(completions, **kwargs):\n    while True:\n        time.sleep(0.05)\n",
    )
    (func,) = get_reward_funcs([name], extra_dirs=[tmp_path])
    threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM)).start()
    expected = rf"signal 15 during reward `{name}`, still running 0.5 s later \(running for \d+ s\): stopping at once"
    with pytest.raises(StopRequested, match=expected):
        func(completions=COMPLETIONS)


def test_a_signal_during_a_reward_that_returns_within_the_grace_stops_gracefully(
    tmp_path: Path, graceful_stop_installed: GracefulStop, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The flaky case of a Ctrl-C landing in a healthy reward call: the call finishes, the step's checkpoint is
    saved. The timer that would interrupt an overdue call fires after the call returned and must change nothing."""
    monkeypatch.setattr(stopping, "REWARD_STOP_GRACE_S", 0.6)
    name = unique("slow")
    write_plugin(
        tmp_path,
        f"import time\n\n\n@reward()\ndef {name}(completions, **kwargs):\n    time.sleep(0.4)\n"
        "    return [1.0] * len(completions)\n",
    )
    (func,) = get_reward_funcs([name], extra_dirs=[tmp_path])
    threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGINT)).start()
    assert func(completions=COMPLETIONS) == [1.0] * len(COMPLETIONS)
    assert graceful_stop_installed.requested
    time.sleep(0.5)  # past the grace: the timer found the call returned and sent nothing
    assert graceful_stop_installed.requested and graceful_stop_installed._overdue is None

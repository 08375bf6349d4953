"""Whether every completion got a reward from at least one of a recipe's rewards.

None is a reward's way to say "not mine" (a GeoQA reward on a shapes row in a mixed dataset): another reward scores
that completion. A completion that no reward scores is worse than unscored: TRL sums the rewards with NaN as 0, so
it gets reward 0, and when every completion of a step is so, the loss and the gradient are 0 and the run trains
nothing while exiting 0. The rewards of one scoring (training's `_calculate_rewards`, an evaluation record) are called
one after another on the same completions; a `RewardRound` collects which completions each left unscored and, when
the last has run, says which completions none scored.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

SHOWN = 5  # row ids quoted in the message; the rest are counted


class RewardRound:
    """The None masks of one scoring by a recipe's rewards, by the reward's position in the recipe's list, and the
    completions a reward's fault left unscored under `reward_faults: skip` (exempt: they are meant to get nothing)."""

    def __init__(self, rewards: Sequence[str]) -> None:
        self.rewards = list(rewards)  # each reward as the message names it: `name` (file)
        self._unscored: dict[int, list[bool]] = {}
        self._skipped: list[bool] = []
        self._last_skipped: list[bool] | None = None
        self._lock = threading.Lock()

    def add(
        self, position: int, values: Sequence[float | None], columns: dict[str, Any], skipped: Sequence[bool] = ()
    ) -> str | None:
        """Record the values of the reward at `position` (and the completions its faults made it skip); once every
        reward has run on these completions, what is wrong if some completion that none skipped got None from all of
        them (else None). A reward called again before the round is complete starts a new round (a caller that
        scores with some of the rewards only)."""
        with self._lock:
            if position in self._unscored or any(len(mask) != len(values) for mask in self._unscored.values()):
                self._unscored.clear()
                self._skipped = []
            self._unscored[position] = [value is None for value in values]
            before = self._skipped or [False] * len(values)
            self._skipped = [a or b for a, b in zip(before, skipped or [False] * len(values), strict=True)]
            if len(self._unscored) < len(self.rewards):
                return None
            masks, self._unscored = list(self._unscored.values()), {}
            self._last_skipped, self._skipped = self._skipped, []
        skip = self._last_skipped
        unscored = [i for i in range(len(values)) if all(mask[i] for mask in masks) and not skip[i]]
        if not unscored:
            return None
        ids = columns.get("id")
        rows = list(dict.fromkeys(str(ids[i]) if ids is not None and i < len(ids) else f"#{i}" for i in unscored))
        shown = ", ".join(rows[:SHOWN]) + (f" and {len(rows) - SHOWN} more" if len(rows) > SHOWN else "")
        return (
            f"no reward scored {len(unscored)} of {len(values)} completions (rows id={shown}): every reward returned "
            f"None for them ({', '.join(self.rewards)}). None means 'not mine, another reward scores it'; scored by "
            "none, a completion gets reward 0 and teaches nothing (all of a step: loss 0, gradient 0). Return a number "
            "for such rows, or add a reward that scores them"
        )

    def take_skipped(self) -> list[bool] | None:
        """Which completions of the last complete round a fault skipped (None: no round completed since the last
        call)."""
        with self._lock:
            skipped, self._last_skipped = self._last_skipped, None
        return skipped

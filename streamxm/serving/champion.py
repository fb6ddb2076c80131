"""Which model answers ``model: "auto"``: the champion of each direction, by evidence.

The evidence is each model's rolling test-then-train mAP in that direction (every learner
scores each pair before it learns it, :class:`~streamxm.learning.stats.WorkerStats`), read with
its pairs processed. The rule, per direction:

- a model is *eligible* once ``min_pairs`` pairs stand behind its rolling mAP;
- with no champion yet, the eligible model of highest mAP becomes it (ties: by name);
- a challenger replaces the champion only when its mAP exceeds the champion's by ``margin``
  (absolute) at ``confirmations`` consecutive evaluations in a row: the hysteresis that keeps
  two models of nearly equal quality, whose rolling figures cross back and forth by noise, from
  flapping the champion (and its alert);
- a champion that is no longer served (its learner gone) is replaced at once;
- before any model is eligible, the model with the most pairs seen answers (so a lone model
  serves ``auto`` from its first checkpoint), without being called champion.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from streamxm.models import DIRECTIONS

__all__ = ["ChampionRule", "Evidence"]


@dataclass(frozen=True)
class Evidence:
    """One model's standing in one direction."""

    rolling_map: float | None
    pairs: int


@dataclass
class ChampionRule:
    """The champion per direction, updated by :meth:`update` with fresh evidence.

    >>> rule = ChampionRule(min_pairs=100, margin=0.01, confirmations=2)
    >>> rule.update({"fast": {"i2t": Evidence(0.30, 500), "t2i": Evidence(0.20, 500)},
    ...              "deep": {"i2t": Evidence(0.305, 500), "t2i": Evidence(0.25, 500)}})
    >>> rule.champions
    {'i2t': 'deep', 't2i': 'deep'}
    >>> for _ in range(2):  # fast ahead by more than the margin, twice in a row: it takes over
    ...     rule.update({"fast": {"i2t": Evidence(0.33, 900), "t2i": Evidence(0.20, 900)},
    ...                  "deep": {"i2t": Evidence(0.31, 900), "t2i": Evidence(0.25, 900)}})
    >>> rule.champions["i2t"], rule.changes
    ('fast', 1)
    """

    min_pairs: int = 200
    margin: float = 0.005
    confirmations: int = 3
    champions: dict[str, str | None] = field(
        default_factory=lambda: dict.fromkeys(DIRECTIONS, None)
    )
    #: Direction -> (challenger, consecutive evaluations it has led by the margin).
    _leads: dict[str, tuple[str, int]] = field(default_factory=dict)
    #: Champion changes so far (a first champion is not a change).
    changes: int = 0
    fallback: str | None = None  # answers auto before any model is eligible

    def update(self, evidence: dict[str, dict[str, Evidence]]) -> None:
        """Take one evaluation of every served model's evidence (model -> direction -> it)."""
        self.fallback = max(
            sorted(evidence),
            default=None,
            key=lambda m: max((e.pairs for e in evidence[m].values()), default=0),
        )
        for direction in DIRECTIONS:
            self._update(
                direction, {m: e[direction] for m, e in evidence.items() if direction in e}
            )

    def _update(self, direction: str, standing: dict[str, Evidence]) -> None:
        eligible = {
            m: float(e.rolling_map)
            for m, e in standing.items()
            if e.rolling_map is not None and e.pairs >= self.min_pairs
        }
        current = self.champions.get(direction)
        if current not in standing:  # none yet, or its learner is gone
            current = None
        if not eligible:
            self._set(direction, current)
            return
        best = min(eligible, key=lambda m: (-eligible[m], m))
        if current is None or current not in eligible:
            self._set(direction, best)
            return
        if best == current or eligible[best] < eligible[current] + self.margin:
            self._leads.pop(direction, None)
            return
        leader, count = self._leads.get(direction, (best, 0))
        count = count + 1 if leader == best else 1
        if count >= self.confirmations:
            self._set(direction, best)
        else:
            self._leads[direction] = (best, count)

    def _set(self, direction: str, model: str | None) -> None:
        before = self.champions.get(direction)
        self._leads.pop(direction, None)
        if model != before:
            self.changes += before is not None  # a first champion is no change
            self.champions[direction] = model

    def answer(self, direction: str) -> str | None:
        """The model that answers ``auto`` in ``direction``: its champion, else the fallback."""
        return self.champions.get(direction) or self.fallback

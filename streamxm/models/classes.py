"""Class columns for models that keep per-class statistics: labels seen so far, bounded."""

from __future__ import annotations

__all__ = ["ClassIndex"]


class ClassIndex:
    """Maps label values to columns in order of first appearance, up to ``max_classes``.

    Labels arriving once the index is full are ignored; :attr:`ignored_labels` counts them (only
    when the caller says the pair is arriving, so a replayed pair is not counted twice).

    >>> idx = ClassIndex(max_classes=2)
    >>> idx.columns((7, 3)), idx.columns((3, 9)), idx.ignored_labels, idx.classes
    ([0, 1], [1], 1, [7, 3])
    """

    def __init__(self, max_classes: int = 1000) -> None:
        if max_classes < 1:
            raise ValueError("max_classes must be >= 1")
        self.max_classes = int(max_classes)
        self.classes: list[int] = []
        self.index: dict[int, int] = {}
        self.ignored_labels = 0

    def __len__(self) -> int:
        return len(self.classes)

    def columns(self, labels: tuple[int, ...] | list[int], arriving: bool = True) -> list[int]:
        """Columns of ``labels``, adding the new ones while there is room."""
        cols = []
        for label in labels:
            if label not in self.index:
                if len(self.classes) >= self.max_classes:
                    self.ignored_labels += arriving
                    continue
                self.index[label] = len(self.classes)
                self.classes.append(label)
            cols.append(self.index[label])
        return cols

    def restore(self, classes: list[int], ignored_labels: int) -> None:
        """Load what :attr:`classes` and :attr:`ignored_labels` held (from a checkpoint)."""
        self.classes = [int(c) for c in classes]
        self.index = {c: i for i, c in enumerate(self.classes)}
        self.ignored_labels = int(ignored_labels)

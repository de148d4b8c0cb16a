"""What one visualization run produced: its catalog, dataset, figures and extra files.

Its own module so that the report (tensor_viz.report) can read a run's result without
importing the pipeline that builds it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tensor_viz.catalog import Catalog
from tensor_viz.data import Dataset
from tensor_viz.figures import FigureSet

if TYPE_CHECKING:
    from tensor_viz.diagnose import Diagnosis


@dataclass
class Result:
    catalog: Catalog
    dataset: Dataset
    figures: FigureSet
    files_read: int = 0
    extra_files: list[str] = field(default_factory=list)   # quick_analysis.png, tensor_stats.txt, ...
    #: nothing new since the report in the output folder: its stored summary (tensor_viz.report_stamp)
    reused: dict | None = None
    #: the findings of the capture (tensor_viz.pipeline.diagnosis), when the run took them
    diagnosis: Diagnosis | None = None

    @property
    def drawn(self) -> int:
        return int(self.reused["drawn"]) if self.reused else self.figures.drawn()

    @property
    def exit_code(self) -> int:
        """0 when at least one real figure was drawn, 1 when nothing could be drawn."""
        return 0 if self.drawn else 1

"""Explaining a whole dataset: folders of images -> resumable per-input results, a table and a gallery.

``explain_dataset`` (:mod:`.driver`) discovers the inputs (:mod:`.inputs`) and any
folder of per-input feature masks (:mod:`.mask_folders`), sends them to an executor
(:mod:`.executors`: in-process, local processes or Ray actors) that runs :func:`incrinf.occlusion` per input
(:mod:`.job`), commits each result to the run folder (:mod:`.store`) and derives the table, dataset statistics
(:mod:`.stats`), report (:mod:`.report`) and gallery (:mod:`.gallery`) from the records.
"""

from __future__ import annotations

from incrinf.explain.dataset.driver import DatasetInterrupted, explain_dataset, imagenet_labels
from incrinf.explain.dataset.report import DatasetReport

__all__ = ["DatasetInterrupted", "DatasetReport", "explain_dataset", "imagenet_labels"]

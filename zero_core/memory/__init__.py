"""Model-state memory per rank, one model of it: the records a report is made of (``records.py``), what
this rank holds now, measured from live tensors (``measured.py``), what it holds by the formulas, read
from each unit's :class:`~zero_core.offload_plan.UnitOffload` (``predicted.py``), and the estimate
before launch, the formulas summed over the model's units as the engine plans them (``estimate.py``)."""

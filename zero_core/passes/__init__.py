"""One pass: forward and backward over the units, and the optimizer step between passes.

The step drives the units (``zero_core.unit``), never the reverse; only the engine and the
model-level modules (full parameters, state_dict hooks, model changes) reach into it.
"""

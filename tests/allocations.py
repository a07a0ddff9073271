"""The most bytes torch's allocator holds at once during a call, beyond what it held before: read from the
profiler's memory events (every allocation and free, on the CPU too), not from what the code under test
reports about itself."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from torch.profiler import ProfilerActivity, profile


def peak_allocated_bytes(call: Callable[[], object], trace: Path) -> int:
    """Run ``call`` under the profiler (its trace written to ``trace``) and return the peak of the bytes
    allocated during it and still alive, over every allocation and free in the order they happened."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        call()
    profiler.export_chrome_trace(str(trace))
    events = [event for event in json.loads(trace.read_text())["traceEvents"] if event.get("name") == "[memory]"]
    events.sort(key=lambda event: (event["ts"], event["args"]["Ev Idx"]))
    live = peak = 0
    for event in events:
        live += event["args"]["Bytes"]
        peak = max(peak, live)
    return peak

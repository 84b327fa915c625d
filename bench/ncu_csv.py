"""An Nsight Compute raw CSV (ncu --csv --page raw): its metric names, their units and one row
a profiled kernel, the lines ncu prints before the table skipped."""
import csv

_TO_NS = {"ns": 1.0, "nsecond": 1.0, "us": 1e3, "usecond": 1e3, "ms": 1e6, "msecond": 1e6,
          "s": 1e9, "second": 1e9}


def read_raw(path):
    """(names, units, kernels): kernels a list of {name: value string}; ([], [], []) when the
    file holds no table (ncu profiled nothing)."""
    with open(path, newline="") as f:
        rows = [r for r in csv.reader(f) if r]
    head = next((i for i, r in enumerate(rows) if r[0] == "ID"), None)
    if head is None or len(rows) < head + 2:
        return [], [], []
    names, units = rows[head], rows[head + 1]
    return names, units, [dict(zip(names, r)) for r in rows[head + 2:] if len(r) == len(names)]


def number(value):
    """A metric's value as ncu prints it ("19,218,496"), or None."""
    try:
        return float(value.replace(",", ""))
    except (AttributeError, ValueError):
        return None


def nanoseconds(value, unit):
    """A duration in the unit of its column, in nanoseconds (None if it is none)."""
    x = number(value)
    return None if x is None or unit not in _TO_NS else x * _TO_NS[unit]

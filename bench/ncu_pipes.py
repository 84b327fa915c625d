"""The headline of an Nsight Compute raw CSV (ncu --page raw --csv): duration, the pipes' use
(tensor, MUFU = xu, FMA, ALU), issue activity and the largest warp stall reasons, of its
first kernel."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ncu_csv import number, read_raw  # noqa: E402

names, _, kernels = read_raw(sys.argv[1])
if not kernels:
    print(sys.argv[1], "no rows")
    sys.exit(0)
vals = kernels[0]
print(sys.argv[1].split("/")[-1], vals.get("Kernel Name", "")[:60])
stalls = []
for n in names:
    v = vals[n]
    if n.startswith("smsp__average_warp_latency_issue_stalled") or \
            n.startswith("smsp__average_warps_issue_stalled"):
        x = number(v)
        if x is not None:
            stalls.append((x, n))
    elif (n.startswith("gpu__time_duration.sum") or n == "launch__registers_per_thread" or
          ("pct_of_peak_sustained_active" in n and
           any(w in n for w in ("pipe", "issue_active", "inst_executed", "sm__throughput")))):
        print("  ", n, v)
for v, n in sorted(stalls, reverse=True)[:12]:
    print("   stall", n, v)

"""The headline of an Nsight Compute raw CSV (ncu --page raw --csv): duration, the pipes' use
(tensor, MUFU = xu, FMA, ALU), issue activity and the largest warp stall reasons."""
import csv
import sys

rows = [r for r in csv.reader(open(sys.argv[1])) if r]
head = next((i for i, r in enumerate(rows) if r[0] == "ID"), None)
if head is None or len(rows) < head + 3:
    print(sys.argv[1], "no rows")
    sys.exit(0)
names, vals = rows[head], rows[head + 2]
print(sys.argv[1].split("/")[-1], vals[names.index("Kernel Name")][:60] if "Kernel Name" in names else "")
stalls = []
for n, v in zip(names, vals):
    if n.startswith("smsp__average_warp_latency_issue_stalled") or \
            n.startswith("smsp__average_warps_issue_stalled"):
        try:
            stalls.append((float(v.replace(",", "")), n))
        except ValueError:
            pass
    elif (n.startswith("gpu__time_duration.sum") or n == "launch__registers_per_thread" or
          ("pct_of_peak_sustained_active" in n and
           any(w in n for w in ("pipe", "issue_active", "inst_executed", "sm__throughput")))):
        print("  ", n, v)
for v, n in sorted(stalls, reverse=True)[:12]:
    print("   stall", n, v)

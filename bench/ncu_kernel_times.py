"""Where a run's GPU time goes, kernel by kernel, from an Nsight Compute raw CSV of its
launches' durations, e.g. one micro-batch's layers of a train_bench step:

  ncu --clock-control none --metrics gpu__time_duration.sum --csv --page raw \\
      train_bench ... > kernels.csv
  python3 bench/ncu_kernel_times.py kernels.csv [--json out.json]

Prints each kernel (its name without namespaces, template arguments and parameters) with
its launches, total and mean time and share of the whole, sorted by total, then the totals
of three classes: matmuls (cuBLAS/cuBLASLt's kernels), attention, and the rest (norms,
RoPE, SwiGLU, casts, copies...). ncu runs the kernels one at a time, so the times are each
kernel's own, without the overlap of streams."""
import argparse
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ncu_csv import nanoseconds, read_raw  # noqa: E402

_DURATION = "gpu__time_duration.sum"
_CLASSES = (("matmul", re.compile(r"gemm|nvjet|cutlass|xmma", re.I)),
            ("attention", re.compile(r"attention|HopperForward|HopperDq|HopperDkDv", re.I)))


def short_name(name):
    """'void ns::(anonymous namespace)::Kernel<128, 0>(float *, int)' -> 'Kernel'."""
    s = re.sub(r"^void\s+", "", name.strip())
    # The anonymous namespace, as the demangler ("(anonymous namespace)") or ncu ("<unnamed>",
    # its "<" sometimes lost) writes it.
    s = re.sub(r"\(anonymous namespace\)|<?unnamed>", "anon", s)
    depth, cut = 0, len(s)
    for i, ch in enumerate(s):  # drop the parameter list: the first '(' outside <...>
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif ch == "(" and depth == 0:
            cut = i
            break
    s = s[:cut]
    while "<" in s:  # template arguments, innermost first
        s2 = re.sub(r"<[^<>]*>", "", s)
        if s2 == s:
            break
        s = s2
    return s.split("::")[-1].strip() or name


def kernel_class(name):
    return next((c for c, pattern in _CLASSES if pattern.search(name)), "other")


def summarise(path):
    names, units, kernels = read_raw(path)
    if _DURATION not in names:
        raise SystemExit(f"{path}: no {_DURATION} column (ncu --metrics {_DURATION})")
    unit = units[names.index(_DURATION)]
    if nanoseconds("1", unit) is None:
        raise SystemExit(f"{path}: {_DURATION} in an unknown unit {unit!r}")
    by_kernel, classes, total = {}, {}, 0.0
    for k in kernels:
        ns = nanoseconds(k[_DURATION], unit)
        if ns is None:
            continue
        name = short_name(k.get("Kernel Name", ""))
        entry = by_kernel.setdefault(name, {"kernel": name, "class": kernel_class(name),
                                            "launches": 0, "ns": 0.0})
        entry["launches"] += 1
        entry["ns"] += ns
        classes[entry["class"]] = classes.get(entry["class"], 0.0) + ns
        total += ns
    rows = sorted(by_kernel.values(), key=lambda e: -e["ns"])
    return {"file": os.path.basename(path), "total_ms": total / 1e6,
            "kernels": [{"kernel": e["kernel"], "class": e["class"], "launches": e["launches"],
                         "total_ms": e["ns"] / 1e6, "mean_us": e["ns"] / e["launches"] / 1e3,
                         "share": e["ns"] / total if total else 0.0} for e in rows],
            "classes": {c: {"total_ms": ns / 1e6, "share": ns / total if total else 0.0}
                        for c, ns in sorted(classes.items(), key=lambda kv: -kv[1])}}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("csv")
    parser.add_argument("--json", help="also write the summary here")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    s = summarise(args.csv)
    print(f"{s['file']}: {s['total_ms']:.3f} ms of kernels")
    print(f"  {'kernel':<48} {'class':<9} {'launches':>8} {'ms':>10} {'mean us':>9} {'share':>6}")
    for k in s["kernels"][:args.top]:
        print(f"  {k['kernel'][:48]:<48} {k['class']:<9} {k['launches']:>8} "
              f"{k['total_ms']:>10.3f} {k['mean_us']:>9.1f} {100 * k['share']:>5.1f}%")
    for c, v in s["classes"].items():
        print(f"  class {c:<10} {v['total_ms']:>10.3f} ms {100 * v['share']:>5.1f}%")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(s, f, indent=1)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""The card's clock and power over marked spans of a run (bench/run.sh power).

smi.csv: `nvidia-smi --query-gpu=timestamp,utilization.gpu,clocks.sm,power.draw,... --format=csv
-lms 100`; marks.txt: lines "YYYY/MM/DD HH:MM:SS.mmm start|end NAME" (UTC, as nvidia-smi's
timestamps on these machines). For each span: the samples in it with the GPU busy (utilization
>= 90%), their SM clock and power (median, p10, p90), and the share of them with each
clock-event reason active. Usage: smi_spans.py smi.csv marks.txt [--json OUT]
"""
import argparse
import csv
import datetime
import json


def stamp(text):
    return datetime.datetime.strptime(text.strip(), "%Y/%m/%d %H:%M:%S.%f")


def number(text):
    return float(text.strip().split()[0])


def quantiles(xs):
    xs = sorted(xs)
    at = lambda q: xs[min(len(xs) - 1, int(q * len(xs)))]
    return {"median": at(0.5), "p10": at(0.1), "p90": at(0.9)}


def read_samples(smi_path):
    """The rows of an nvidia-smi --format=csv log (with its header) as dicts, timestamps parsed;
    rows cut short or unparseable (the log's last, when the sampler was stopped) left out."""
    with open(smi_path) as f:
        rows = [r for r in csv.reader(f) if r]
    if not rows:
        return []
    header = [h.strip() for h in rows[0]]
    samples = []
    for r in rows[1:]:
        if len(r) != len(header):
            continue
        try:
            samples.append({h: (stamp(v) if h == "timestamp" else v.strip()) for h, v in zip(header, r)})
        except ValueError:
            continue
    return samples


def spans(smi_path, marks_path):
    samples = read_samples(smi_path)
    header = list(samples[0]) if samples else []
    opened, out = {}, []
    for line in open(marks_path):
        parts = line.split()
        if len(parts) < 4:
            continue
        t, what, name = stamp(parts[0] + " " + parts[1]), parts[2], " ".join(parts[3:])
        if what == "start":
            opened[name] = t
            continue
        t0 = opened.pop(name, None)
        if t0 is None:
            continue
        inside = [s for s in samples if t0 <= s["timestamp"] <= t]
        busy = [s for s in inside if number(s["utilization.gpu [%]"]) >= 90]
        span = {"span": name, "seconds": round((t - t0).total_seconds(), 1),
                "samples": len(inside), "busy_samples": len(busy)}
        if busy:
            span["sm_mhz"] = quantiles([number(s["clocks.current.sm [MHz]"]) for s in busy])
            span["watts"] = quantiles([number(s["power.draw [W]"]) for s in busy])
            for h in header:
                if h.startswith("clocks_event_reasons"):
                    active = sum(1 for s in busy if s[h].lower().startswith("active"))
                    span[h.split(".", 1)[1] + "_share"] = round(active / len(busy), 3)
        out.append(span)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("smi")
    ap.add_argument("marks")
    ap.add_argument("--json")
    a = ap.parse_args()
    result = spans(a.smi, a.marks)
    for s in result:
        print(json.dumps(s))
    if a.json:
        json.dump(result, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()

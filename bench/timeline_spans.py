# The spans of a train_bench --timeline file: each stream's busy time, and the compute
# stream's spans (label, start ms, duration ms), to compare layers' forward and backward.
# Usage: python3 bench/timeline_spans.py TIMELINE.json
import json, sys, collections
t = json.load(open(sys.argv[1]))
by = collections.defaultdict(list)
for e in t:
    by[e['stream']].append(e)
for s, ev in sorted(by.items()):
    ev.sort(key=lambda e: e['start_ms'])
    busy = sum(e['end_ms'] - e['start_ms'] for e in ev)
    span = ev[-1]['end_ms'] - ev[0]['start_ms']
    print(f"stream {s}: {len(ev)} spans, busy {busy:.1f} ms of {span:.1f} ms")
    if s == 0:
        for e in ev:
            print(f"  {e['label']:>14} {e['start_ms']:9.1f} {e['end_ms'] - e['start_ms']:8.1f}")

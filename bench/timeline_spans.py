# The spans of a train_bench --timeline file: each stream's busy time, the compute stream's
# spans (label, start ms, duration ms), to compare layers' forward and backward, and the CPU
# optimizer's pieces (stream 3, on the host's clock) by unit: parameters, milliseconds from
# landing to done, their rate, and how long the optimizer waited for the pieces to land.
# Usage: python3 bench/timeline_spans.py TIMELINE.json
import json, sys, collections
t = json.load(open(sys.argv[1]))
by = collections.defaultdict(list)
for e in t:
    by[e['stream']].append(e)
for s, ev in sorted(by.items()):
    ev.sort(key=lambda e: e['start_ms'])
    busy = sum(e['end_ms'] - e.get('ready_ms', e['start_ms']) for e in ev)
    span = ev[-1]['end_ms'] - ev[0]['start_ms']
    name = 'optimizer' if s == 3 else f'stream {s}'
    print(f"{name}: {len(ev)} spans, busy {busy:.1f} ms of {span:.1f} ms")
    if s == 0:
        for e in ev:
            print(f"  {e['label']:>14} {e['start_ms']:9.1f} {e['end_ms'] - e['start_ms']:8.1f}")
    if s == 3:
        units = collections.OrderedDict()
        for e in ev:
            u = units.setdefault(e['label'], [e['ready_ms'], 0, 0.0, 0.0])
            u[1] += e['params']
            u[2] += e['end_ms'] - e['ready_ms']
            u[3] += e['ready_ms'] - e['start_ms']
        print(f"  {'unit':>14} {'first ms':>9} {'params':>12} {'ms':>8} {'G/s':>6} {'waited ms':>9}")
        for label, (first, params, ms, waited) in units.items():
            rate = params / ms / 1e6 if ms > 0 else 0
            print(f"  {label:>14} {first:9.1f} {params:12d} {ms:8.1f} {rate:6.2f} {waited:9.1f}")

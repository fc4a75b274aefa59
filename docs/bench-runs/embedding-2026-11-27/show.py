import json, sys, statistics as st
for n in sys.argv[1:]:
    d = json.load(open(f"{n}.json"))  # a path without .json
    e = d[0]["engine_stats"]; x = e.get("experts") or {}
    dec = [r["decode_tokens_per_second"] for r in d]
    ft = [r["prefill_seconds"] for r in d]
    print(f"{n:22s} decode {st.median(dec):6.1f} ({min(dec):.1f}-{max(dec):.1f}) prefill {st.median(ft):.3f} majflt {[r.get('cgroup_major_faults') for r in d]} "
          f"mapped {e['experts_mapped']} cache {x.get('budget_bytes', 0) / e['model']['expert_bytes']:.3f} hits {d[0].get('expert_hit_rate')}")

import sys
from pyedgemoe import memory_budget as mb
from pyedgemoe.load_plan import plan_for, LoadOptions
from pyedgemoe.model_info import read_model_info
path = sys.argv[1]
info = read_model_info(path)
avail = mb.available_memory()
print("available", avail)
import pyedgemoe.memory_budget as m
orig = m.auto_expert_cache
def spy(expert_bytes, non_expert_bytes, context, available=None, repacked=0, cold=0, minimum=0):
    a, _ = m._measured(available)
    room = m.room_for_experts_bytes(non_expert_bytes, context, a)
    print(f"expert {expert_bytes/2**30:.3f} non {non_expert_bytes/2**30:.3f} context {context/2**20:.0f}MiB cold {cold/2**20:.0f}MiB "
          f"room {room/2**30:.3f} cache share {room/expert_bytes:.3f} mapped share {(room+context+cold)/expert_bytes:.3f} "
          f"page cache after anon(non-cold+ctx) {(a-non_expert_bytes+cold-context)/expert_bytes:.3f}")
    return orig(expert_bytes, non_expert_bytes, context, available, repacked, cold, minimum)
m.auto_expert_cache = spy
import pyedgemoe.load_plan as lp
lp.parse_expert_cache.__globals__["auto_expert_cache"] = spy
info, plan = plan_for(path, LoadOptions(n_ctx=int(sys.argv[2]), flash_attn=False))

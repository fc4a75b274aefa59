// The only part of the layer that patched llama.cpp calls (patch 0002: llama_moe_expert_hook in
// build_moe_ffn). A process-wide registry maps a model's stacked expert tensors to the
// expert_residency that serves them; tensors of other models pass through untouched.
#pragma once

class expert_residency;

void moe_hook_register(expert_residency * residency);
void moe_hook_unregister(expert_residency * residency);

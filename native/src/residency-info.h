// What an expert residency reports about itself once built (expert_residency::info): its budget,
// pools and slots, the host tier's, the experts' bytes and how they are read.
#pragma once

#include "expert-budget.h"
#include "expert-layout.h"
#include "expert-residency.h"
#include "host-tier.h"

// Fills info's sizes from the built pieces (host: null without a host tier); the device pools'
// bytes and --mode auto's reason are the constructor's to fill.
void describe_residency(expert_residency_info & info, const expert_layout & layout, const expert_budget & budget,
                        const tier_pools & pools, const host_tier * host, expert_io io, int predictor_depth);

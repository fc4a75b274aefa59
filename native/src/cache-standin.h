// Cache-aware routing by calibrated stand-ins: where a token's selected expert e is not cached, the
// cached expert c that the token did not select and whose output came nearest to e's on the
// calibration text takes e's row and weight, if that cost, w_e * cost[e][c], is within the layer's
// bound tau; or, where the table has drop costs and w_e * drop[e] is cheaper still, no expert does
// (the selection is dropped, its weight with it). cost[e][c] is the mean of ||f_c(h) - f_e(h)|| / ||h||
// over the calibration tokens whose router chose e (h: the layer's input, f: an expert's FFN),
// drop[e] the mean of ||f_e(h)|| / ||h||; `pyedgemoe calibrate --stand-ins` measures them and the
// quantiles of the calibration's own swap costs, and tau is the quantile --stand-in asks for
// (pyedgemoe/calibration/stand_ins.py). Chosen by what the experts compute, where Cache-Prior
// (cache-routing.h) chooses by the router's scores: in an offline simulation of both trained models
// the router's scores found worse stand-ins (docs/systems.md, "Cache-aware routing"). Lossy; a pure
// function of one layer's routing and what is cached.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <tuple>
#include <vector>

struct stand_in_table {
    int n_expert = 0;
    std::vector<float> cost;  // [e][c], n_expert x n_expert
    std::vector<float> drop;  // [e], or empty: no selection is dropped
    double tau = 0;           // the largest cost of a swap or a drop
};

// A layer's table as given: costs (n_expert x n_expert row-major), drop costs (n_expert, or none), tau.
using stand_in_costs = std::tuple<std::vector<float>, std::vector<float>, double>;

// Per il (n_layers of them), the tables of layers; an empty table where none is given. Throws
// std::invalid_argument for a layer that is not one of moe_layers or costs of another size.
std::vector<stand_in_table> stand_in_tables(const std::map<int, stand_in_costs> & layers, const std::vector<int> & moe_layers,
                                            int n_layers, int n_expert);

// ids [n_tokens][k] rewritten in place (the weights stay with their rows), selections in order; a
// stand-in taken by one selection is the token's, so the next looks further; dropped [n_tokens][k]
// set to 1 where a selection is dropped (its id left as it was). Returns the selections changed.
int stand_in(int32_t * ids, uint8_t * dropped, const float * weights, int64_t n_tokens, int k, const stand_in_table & table,
             const std::function<bool(int)> & cached);

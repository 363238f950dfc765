#!/usr/bin/env bash
# The routing regression guard: every scenario S1-S11 of docs/SCENARIOS.md, at the guard's size
# (the conversation trace's first 1,500 requests, bench-baseline/conversation-head.jsonl, for
# S1-S4 and S6; shortened generated traces for the rest), under every built-in policy in
# `kvgate sim`, its TTFT mean, TTFT p99, session makespan p99 (S9) and cache hit rate compared
# with the committed baseline bench-baseline/routing.json. Fails (exit 1) when a figure is more
# than 3% worse; prints the table of every figure that moved either way. The simulator is
# deterministic: a move is a routing (or engine model) change, never noise.
#
#   scripts/routing_guard.sh                      # compare (what .ci/run does)
#   scripts/routing_guard.sh --update             # rewrite the baseline with this run's figures
#   scripts/routing_guard.sh --scenarios S9,S10 --policies kv_aware,cache_aware   # a subset
#   scripts/routing_guard.sh --help               # every option
#
# Updating the baseline is a deliberate step: run it with --update, commit the new
# bench-baseline/routing.json with the change that moved the figures, and say in the commit
# message which figures moved and why (the table this prints is the list).
#
# Built with the dev profile, whose simulator crates are optimised (Cargo.toml), sharing the
# test build's artifacts.
set -euo pipefail
cd "$(dirname "$0")/.."
exec cargo run --quiet -p kvgate-sim --bin routing-guard -- "$@"

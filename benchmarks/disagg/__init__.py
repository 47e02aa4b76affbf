"""Planning and measuring disaggregated prefill/decode serving (DistServe, Zhong et al., OSDI
2024); the serving itself (the router, the local deployment) is `jaxgen.entrypoints.disagg`.

planner: a latency model of prefill steps, decode steps and KV transfers, fitted to measured
step times; simulator: a discrete-event simulator of a colocated or disaggregated deployment;
search: DistServe's placement search for the highest per-device goodput under TTFT/TPOT SLOs;
traces: seeded synthetic workloads. Pure Python (numpy for the fits): no jax at import time.
sim: the planner's study (`python -m benchmarks disagg-sim`); measure: a 1P1D deployment
against colocated instances beside the simulator (`python -m benchmarks.disagg`).
"""

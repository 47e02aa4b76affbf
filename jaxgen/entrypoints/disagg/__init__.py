"""Planning for disaggregated prefill/decode serving (DistServe, Zhong et al., OSDI 2024).

planner: a latency model of prefill steps, decode steps and KV transfers, fitted to measured
step times; simulator: a discrete-event simulator of a colocated or disaggregated deployment;
search: DistServe's placement search for the highest per-device goodput under TTFT/TPOT SLOs;
traces: seeded synthetic workloads. Pure Python (numpy for the fits): no jax at import time.
"""

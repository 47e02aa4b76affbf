"""Disaggregated prefill/decode serving: the router in front of prefill and decode instances
(`router`) and a whole deployment on one machine (`local`, `jaxgen serve --disaggregated`).
The planner and simulator that study when it pays live outside the package
(`benchmarks.disagg`)."""

"""Trace replay: the real cache engine driven by a workload trace, the offline optimum it is
measured against, capacity sweeps and capacity planning."""

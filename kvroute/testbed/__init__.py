"""What the demo and the benchmarks share: launching a simulated fleet and routers, traces,
workloads, a load generator and its statistics."""

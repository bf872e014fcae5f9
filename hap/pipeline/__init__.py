"""Pipeline parallelism (issue 15): stages of the data-parallel program on device groups,
micro-batches in a GPipe or 1F1B schedule, exact.

- schedule.py: the schedules' orders and their event simulation;
- stages.py: cutting a program, crossings, micro-batches as pieces;
- price.py: the cost model's price of a pipeline;
- partition.py: pivots, device groups, the exact optimal cut;
- plan.py: pipeline Plans (`hap plan --planner pp-exact`);
- runtime.py: hap.Pipeline, which trains one;
- rebalance.py: re-planning a running pipeline for devices measured slower (exact).
"""

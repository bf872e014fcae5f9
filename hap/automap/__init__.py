"""Auto-MAP (seed 004), issue 15: a DQN planner. Built: the DQN (dqn.py: double DQN, dueling
head, epsilon-greedy), its prioritized replay on a sum tree (replay.py), the pipeline task
(pipeline.py: the cut environment on hap's IR and cost model, `hap plan --planner dqn`), and
the operator-partitioning and data-parallel tasks (propagate.py: hap's rules as derivation
rules; opp.py: linkage groups, the environments, `hap plan --planner dqn-opp`). The pipeline
runtime, pricing and exact partition are hap.pipeline. Not built: the offline-trained
inference network for pipelines.
"""

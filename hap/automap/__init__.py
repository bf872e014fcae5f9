"""Auto-MAP (seed 004), issue 15: a DQN planner. The DQN (dqn.py: double DQN, dueling head,
epsilon-greedy), its prioritized replay on a sum tree (replay.py), the pipeline task
(pipeline.py: the cut environment on hap's IR and cost model, trained online, `hap plan
--planner dqn`; pipeline_infer.py: the network trained once on generated arrays that ships as
pp_inference.pt), and the operator-partitioning and data-parallel tasks (propagate.py: hap's
rules as derivation rules; opp.py: linkage groups, the environments, `hap plan --planner
dqn-opp`). The pipeline runtime, pricing and exact partition are hap.pipeline.
"""

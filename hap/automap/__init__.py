"""Auto-MAP (seed 004), issue 15: a DQN planner. Built: the DQN (dqn.py: double DQN, dueling
head, epsilon-greedy), its prioritized replay on a sum tree (replay.py), and the pipeline task
(pipeline.py: the cut environment on hap's IR and cost model, `hap plan --planner dqn`). The
pipeline runtime, pricing and exact partition are hap.pipeline. Not built: the OPP and ADP
environments and the offline-trained inference network.
"""

"""Auto-MAP (seed 004), issue 15: a DQN planner for operator partitioning, data parallelism and
pipeline parallelism. Built so far: the DQN itself (dqn.py: double DQN, dueling head,
epsilon-greedy) and its prioritized replay on a sum tree (replay.py). The environments on
hap's IR, the pipeline runtime, the exact references and the planners are not built yet.
"""

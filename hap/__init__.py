"""hap: train one PyTorch model on a cluster of mixed GPUs by SPMD program synthesis (HAP).

    import hap
    graph = hap.capture(model, example_inputs)          # forward returns the loss
    plan = hap.plan(graph, hap.load_cluster("paper-hetero-8"))
    print(plan.summary())
"""

from .capture import CaptureError, capture
from .cost.cluster import Cluster, ClusterError, Device, load_cluster
from .plan import Plan
from .planner import PlannerConfig, plan

__all__ = ["capture", "CaptureError", "plan", "PlannerConfig", "Plan", "Cluster", "Device", "ClusterError", "load_cluster"]

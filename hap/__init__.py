"""hap: train one PyTorch model on a cluster of mixed GPUs by SPMD program synthesis (HAP).

    import hap
    graph = hap.capture(model, example_inputs)          # forward returns the loss
    plan = hap.plan(graph, hap.load_cluster("paper-hetero-8"))
    print(plan.summary())

    dmodel = hap.HAP(model, cluster, example_inputs)    # on every rank, torch.distributed initialized
    dmodel = hap.HAP(model, cluster, example_inputs, plan=plan, graph=graph)   # or: captured once, sent
    loss = dmodel(*batch); loss.backward(); opt.step()

    pipe = hap.Pipeline(model, cluster, example_inputs, plan)   # a plan of several stages
    loss = pipe.train_step(*batch); opt.step()
"""

import sys as _sys

try:
    from .capture import CaptureError, capture
    from .cost.cluster import Cluster, ClusterError, Device, load_cluster
    from .plan import Plan
    from .planner import PlannerConfig, plan
    from .pipeline.runtime import Pipeline
    from .runtime.module import HAP
except KeyboardInterrupt:
    # `python -m hap` imports this package (torch: seconds) before hap/__main__.py runs: a Ctrl-C
    # then ends as the hap command's does (hap_command.py), not in the import's traceback
    _argv = getattr(_sys, "orig_argv", [])
    if "-m" in _argv[:-1] and _argv[_argv.index("-m") + 1] == "hap":
        from hap_command import interrupted
        raise SystemExit(interrupted()) from None
    raise

__all__ = ["HAP", "Pipeline", "capture", "CaptureError", "plan", "PlannerConfig", "Plan", "Cluster", "Device", "ClusterError", "load_cluster"]

"""A cost model and mesh planner: which mesh for a model on a cluster, and why.

From a model's shape, a global batch, a number of devices and a machine, the planner
predicts a training step's time by parts (compute; tp, cp, pp, dp communication; the
pipeline bubble; the optimizer), the memory per device and the MFU, from first principles
and a few stated efficiency assumptions, for one mesh or every mesh; ``--validate`` checks
it against real minidist runs on this machine.  Modules, one idea each:

* :mod:`.model`: parameters (total and active), FLOPs and activation bytes of a transformer's
  shape, dense or with a mixture of experts;
* :mod:`.machine`: the machines (presets; this machine as calibrated);
* :mod:`.probes`: the probes that measure this machine (each multi-rank one its own mpiexec);
* :mod:`.settings`: a plan (the mesh, ep included, and the step's settings) and the precisions;
* :mod:`.feasible`: why a plan cannot run a model, one line per reason;
* :mod:`.stages`: what each pipeline stage holds (blocks, mixtures, parameters per rank);
* :mod:`.collectives`: one collective's time on one link;
* :mod:`.cost`: the step's time, memory and MFU on one mesh;
* :mod:`.moe_cost`: what experts add: expert parallelism's all-to-all, the experts' reduction;
* :mod:`.search`: every mesh enumerated, the feasible ones ranked;
* :mod:`.validate`: real runs here: this machine calibrated (``--calibrate``), predicted vs
  measured (``--validate``).

    python -m minidist.plan --preset llama3-405b --machine h100-nvlink-ib --gpus 8192 \\
        --seq-len 8192 --global-batch-tokens 16777216 [--mesh tp=8,cp=1,pp=16,dp=64 | --top 5] [--json]
    python -m minidist.plan --preset mixtral-8x7b --gpus 64 --seq-len 4096 --global-batch-tokens 4194304

docs/planner.md explains the model and where it is too simple.  Imports host and layout
(the mesh arithmetic and formulas the runtime uses too), never MPI: ``--validate`` runs the
training command as a separate process.
"""

from minidist.plan.cost import Estimate, Plan, estimate, problems
from minidist.plan.machine import Machine, load
from minidist.plan.model import PRESETS, Preset, active_params, model_flops_per_token, num_params
from minidist.plan.search import search

__all__ = ["Estimate", "Plan", "estimate", "problems", "Machine", "load", "PRESETS", "Preset",
           "active_params", "model_flops_per_token", "num_params", "search"]

"""Expert load over the steps of a run, drawn from its metrics file (``--metrics-jsonl``).

Each record of an ``--experts`` run holds the routers' statistics of the step over the
global batch (observe/router.py).  The figure has one panel per mixture, one line per expert:
the (token, choice) pairs it kept in the step, beside the mean (a balanced router keeps
every line on it), and a last panel with the share dropped over capacity and the
load-balancing loss (Switch Transformer's ``E · sum f_e P_e``, 1 when balanced).
"""

from __future__ import annotations

import json


def read_metrics(text: str, path: str) -> list:
    """The records of a metrics file's ``text`` (one JSON object per line) that carry router
    statistics; a ValueError naming the file when there are none."""
    records = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                raise ValueError(f"{path} line {n} is not JSON: neither a trace nor a metrics file") from None
    routed = [r for r in records if isinstance(r, dict) and r.get("router")]
    if not routed:
        raise ValueError(f"{path} holds no router statistics (a metrics file of a run with --experts has them)")
    return routed


def series(records: list) -> tuple[list, list]:
    """``(steps, load)``: load[mixture][expert] is that expert's kept tokens at each step."""
    steps = [r["step"] for r in records]
    mixtures, experts = len(records[0]["router"]["tokens"]), len(records[0]["router"]["tokens"][0])
    load = [[[r["router"]["tokens"][m][e] for r in records] for e in range(experts)] for m in range(mixtures)]
    return steps, load


def draw(records: list, out: str) -> str:
    """Draw the expert load of ``records`` into ``out`` (PNG, SVG or PDF); a one-line summary."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    steps, load = series(records)
    n = len(load)
    fig, axes = plt.subplots(n + 1, 1, figsize=(10, 2.4 * (n + 1)), sharex=True, squeeze=False)
    for m, per_expert in enumerate(load):
        ax = axes[m][0]
        for e, counts in enumerate(per_expert):
            ax.plot(steps, counts, label=f"expert {e}", linewidth=1.2)
        mean = [sum(c[i] for c in per_expert) / len(per_expert) for i in range(len(steps))]
        ax.plot(steps, mean, "k--", linewidth=1, label="mean")
        ax.set_ylabel("tokens kept")
        ax.set_title(f"mixture {m}: tokens per expert per step (global batch)", fontsize=9)
        ax.legend(fontsize=7, ncol=min(len(per_expert) + 1, 9), loc="upper right", frameon=False)
    ax = axes[n][0]
    ax.plot(steps, [100 * r["router"]["dropped"] for r in records], color="#d94801", label="dropped (%)")
    ax.set_ylabel("dropped (%)")
    twin = ax.twinx()
    twin.plot(steps, [r["router"]["aux_loss"] for r in records], color="#2171b5", label="load-balancing loss")
    twin.set_ylabel("load-balancing loss")
    ax.set_title("dropped share (left) and load-balancing loss, 1 when balanced (right)", fontsize=9)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    last = records[-1]["router"]
    return (f"expert load of {n} mixture(s) over {len(steps)} steps; last step max/mean "
            f"{last['max'] / last['mean'] if last['mean'] else 0:.2f}, dropped {100 * last['dropped']:.1f}%")

"""Which ranks share a node (real: MPI_COMM_TYPE_SHARED; pretend: MINIDIST_RANKS_PER_NODE),
the node layout text, the tp / cp groups across nodes, and the simulated link between nodes."""
import os

import pytest

from minidist.comm import links, nodes
from minidist.layout.mesh import MeshLayout
from minidist.train.config import ParallelConfig
from minidist.train.testing import run_mpi

BODIES = os.path.join(os.path.dirname(__file__), "mpi", "nodes_bodies.py")
TWO_BY_TWO = (0, 0, 1, 1)  # 4 ranks, 2 per node


def test_pretend_nodes_and_the_layout_text():
    assert nodes.pretend_node_ids(4, 2) == TWO_BY_TWO
    assert nodes.pretend_node_ids(5, 2) == (0, 0, 1, 1, 2)
    assert nodes.describe_nodes(TWO_BY_TWO) == "node 0: ranks 0-1, node 1: ranks 2-3"
    assert nodes.describe_nodes(nodes.pretend_node_ids(8, 4)) == "node 0: ranks 0-3, node 1: ranks 4-7"
    assert nodes.describe_nodes((0, 1, 0, 1)) == "node 0: ranks 0 2, node 1: ranks 1 3"
    assert nodes.describe_nodes((0, 0, 1, 0, 0)) == "node 0: ranks 0-1 3-4, node 1: ranks 2"
    assert nodes.consecutive(TWO_BY_TWO) and not nodes.consecutive((0, 1, 0, 1))
    text = nodes.layout_text(TWO_BY_TWO)
    assert text.endswith("node 0: ranks 0-1, node 1: ranks 2-3") and text.startswith("nodes: 2 (")
    assert "round-robin" in nodes.layout_text((0, 1, 0, 1))


@pytest.mark.parametrize("value,expect", [("", None), ("2", 2), (" 8 ", 8)])
def test_ranks_per_node_variable(monkeypatch, value, expect):
    monkeypatch.setenv(nodes.RANKS_PER_NODE, value)
    assert nodes.ranks_per_node() == expect


@pytest.mark.parametrize("value", ["0", "-2", "two", "1.5"])
def test_ranks_per_node_rejects_bad_values(monkeypatch, value):
    monkeypatch.setenv(nodes.RANKS_PER_NODE, value)
    with pytest.raises(ValueError, match="MINIDIST_RANKS_PER_NODE"):
        nodes.ranks_per_node()


def test_tp_group_across_nodes():
    spans = nodes.groups_spanning_nodes(MeshLayout(tp=4), TWO_BY_TWO)
    assert spans == ["tp group [0 1 2 3] spans nodes 0 and 1"]
    (line,) = nodes.layout_warnings(MeshLayout(tp=4), TWO_BY_TWO)
    assert line.startswith("warning: tp group [0 1 2 3] spans nodes 0 and 1:") and "Megatron-LM" in line
    assert nodes.groups_spanning_nodes(MeshLayout(tp=4), (0, 0, 1, 2)) == ["tp group [0 1 2 3] spans nodes 0, 1 and 2"]


def test_tp_inside_nodes_does_not_warn():
    for shape in [dict(dp=2, tp=2), dict(pp=2, tp=2), dict(dp=4), dict(pp=2, dp=2)]:
        assert nodes.groups_spanning_nodes(MeshLayout(**shape), TWO_BY_TWO) == [], shape
        assert nodes.layout_warnings(MeshLayout(**shape), TWO_BY_TWO) == [], shape
    assert nodes.layout_warnings(MeshLayout(tp=4), (0, 0, 0, 0)) == []


def test_cp_group_across_nodes():
    lay = MeshLayout(tp=2, cp=2)
    assert nodes.groups_spanning_nodes(lay, TWO_BY_TWO) == [
        "cp group [0 2] spans nodes 0 and 1", "cp group [1 3] spans nodes 0 and 1"]
    (line,) = nodes.layout_warnings(lay, TWO_BY_TWO)
    assert line.startswith("warning: 2 cp groups span nodes ([0 2] on nodes 0 and 1, [1 3] on nodes 0 and 1)")
    assert "Llama 3" in line and "fills a node" in line
    # tp x cp inside a node of 4: nothing to say; cp across nodes of 2 with tp=1: the other advice
    assert nodes.layout_warnings(lay, (0, 0, 0, 0)) == []
    (line,) = nodes.layout_warnings(MeshLayout(cp=4), TWO_BY_TWO)
    assert "cp group [0 1 2 3]" in line and "divides the ranks per node (2)" in line


def test_round_robin_placement_breaks_tp_and_the_warning_lists_a_few():
    spans = nodes.groups_spanning_nodes(MeshLayout(dp=4, tp=2), (0, 1) * 4)
    assert spans == [f"tp group [{2 * i} {2 * i + 1}] spans nodes 0 and 1" for i in range(4)]
    (line,) = nodes.layout_warnings(MeshLayout(dp=4, tp=2), (0, 1) * 4)
    assert line.startswith("warning: 4 tp groups span nodes (") and ", and 1 more)" in line


def test_a_parallel_config_names_the_same_groups():
    p = ParallelConfig(dp=1, tp=4)
    assert nodes.groups_spanning_nodes(p, TWO_BY_TWO) == ["tp group [0 1 2 3] spans nodes 0 and 1"]


def test_link_scope_checks():
    before = links.link_model(), links.link_scope()
    try:
        with pytest.raises(ValueError, match="scope"):
            links.set_link_model(latency_us=1, scope="intranode")
        links.set_link_model(latency_us=1, scope="internode")
        assert links.link_scope() == "internode" and links.crosses(None, None)  # no destination given: charged
        links.set_link_model()
        assert links.link_scope() == "all" and not links.enabled
    finally:
        links.set_link_model(before[0]["latency_us"], before[0]["gbps"], before[1])


# ---------------------------------------------------------------- under mpiexec


@pytest.mark.mpi
def test_pretend_nodes_on_4_ranks():
    """MINIDIST_RANKS_PER_NODE=2 on 4 ranks: the layout, and which meshes warn."""
    out = run_mpi(4, f"{BODIES}::layout", "node 0: ranks 0-1, node 1: ranks 2-3", timeout=90,
                  env={nodes.RANKS_PER_NODE: "2"}).stdout
    assert out.count("nodes ok") == 4, out
    assert "nodes: 2 (pretend: MINIDIST_RANKS_PER_NODE=2): node 0: ranks 0-1, node 1: ranks 2-3" in out
    assert "tp4 warning: tp group [0 1 2 3] spans nodes 0 and 1:" in out
    assert "dp2tp2" not in out  # tp=2 inside each node: nothing printed
    assert "tp2cp2: cp group [0 2] spans nodes 0 and 1" in out and "tp2cp2 warning: 2 cp groups" in out


@pytest.mark.mpi
def test_real_nodes_on_one_machine():
    """Without the variable, MPI_COMM_TYPE_SHARED finds one node here (checked against MPI's own)."""
    env = {k: v for k, v in os.environ.items() if k != nodes.RANKS_PER_NODE}
    out = run_mpi(4, f"{BODIES}::layout", "node 0: ranks 0-3", timeout=90, env={**env, nodes.RANKS_PER_NODE: ""}).stdout
    assert out.count("nodes ok") == 4, out
    assert "nodes: 1 (MPI_COMM_TYPE_SHARED): node 0: ranks 0-3" in out
    assert "warning" not in out


@pytest.mark.mpi
def test_simulated_link_only_between_pretend_nodes():
    env = {nodes.RANKS_PER_NODE: "2", "MINIDIST_LINK_SCOPE": "internode", "MINIDIST_LINK_LATENCY_US": "20000"}
    out = run_mpi(4, f"{BODIES}::internode_link", timeout=90, env=env).stdout
    assert out.count("internode link ok") == 4, out


@pytest.mark.mpi
def test_simulated_link_through_p2p_only_between_pretend_nodes():
    env = {nodes.RANKS_PER_NODE: "2", "MINIDIST_LINK_SCOPE": "internode", "MINIDIST_LINK_LATENCY_US": "20000"}
    out = run_mpi(4, f"{BODIES}::internode_link_through_p2p", timeout=90, env=env).stdout
    assert out.count("p2p link ok") == 4, out

"""Pipeline schedules as data, checked by simulation (no MPI)."""
import pytest

from minidist.layout.settings import VIRTUAL
from minidist.layout import schedules as S
from minidist.layout.schedules import Action, make_schedule
from minidist.layout.simulate import Deadlock, _message_key, main, simulate


def _valid_configs():
    for name in S.ORDERS:
        for P in (1, 2, 3, 4, 5):
            for M in (1, 2, 3, 4, 6, 8, 9):
                for V in ((1,) if name not in VIRTUAL else (1, 2, 3)):
                    if S.schedule_problem(name, P, M, V) is None:
                        yield name, P, M, V


CONFIGS = list(_valid_configs())


def test_every_schedule_has_configs():
    assert {c[0] for c in CONFIGS} == set(S.ORDERS)
    assert len(CONFIGS) > 150


@pytest.mark.parametrize("t_backward", [1.0, 2.0])
def test_simulation_terminates_matches_messages_and_bubble_equals_formula(t_backward):
    for name, P, M, V in CONFIGS:
        sched = make_schedule(name, P, M, V)
        sim = simulate(sched, t_forward=1.0, t_backward=t_backward)  # raises on deadlock or a lone message
        formula = S.theoretical_bubble(name, P, M, V, t_forward=1.0, t_backward=t_backward)
        for r in range(P):
            assert sim.bubble[r] == pytest.approx(formula, abs=1e-12), (name, P, M, V, r, sim.bubble)


def test_each_forward_precedes_its_backward_and_each_unit_runs_once():
    for name, P, M, V in CONFIGS:
        for rank, actions in enumerate(make_schedule(name, P, M, V).actions):
            seen = []
            for a in actions:
                if a.op == S.BACKWARD:
                    assert (S.FORWARD, a.microbatch, a.chunk) in seen, (name, P, M, V, rank, a)
                if a.op == S.WEIGHT:
                    assert (S.BACKWARD, a.microbatch, a.chunk) in seen, (name, P, M, V, rank, a)
                if a.op in S.SPLIT_COMPUTE:
                    seen.append((a.op, a.microbatch, a.chunk))
            ops = S.SPLIT_COMPUTE if S.splits_backward(name) else S.COMPUTE  # zero-bubble: W too
            assert sorted(seen) == sorted((op, m, c) for op in ops for m in range(M) for c in range(V))


def test_every_send_has_exactly_one_matching_receive():
    for name, P, M, V in CONFIGS:
        sched = make_schedule(name, P, M, V)
        sends, recvs = [], []
        for rank, actions in enumerate(sched.actions):
            for a in actions:
                if a.op in (S.SEND_ACT, S.SEND_GRAD):
                    sends.append((rank, a.peer, _message_key(a, rank, P, sched.placement)))
                elif a.op in (S.RECV_ACT, S.RECV_GRAD):
                    recvs.append((a.peer, rank, _message_key(a, rank, P, sched.placement)))
        assert sorted(sends) == sorted(recvs), (name, P, M, V)
        assert len(set(sends)) == len(sends)
        # every stage boundary crossed by every microbatch, both ways, when ranks differ: all
        # of them with the looping placement, all but the V's turn (stages P-1, P) with ZB-V's
        boundaries = 0 if P == 1 else (P * V - 1) - (sched.placement == S.V_SHAPE)
        assert len(sends) == 2 * M * boundaries


def test_peak_in_flight_closed_forms_are_the_simulators():
    for name, P, M, V in CONFIGS:
        sim = simulate(make_schedule(name, P, M, V))
        assert sim.peak_in_flight == [S.peak_in_flight(name, P, M, r, V) for r in range(P)], (name, P, M, V)


def test_1f1b_holds_at_most_P_microbatches_and_gpipe_holds_M():
    for P in (1, 2, 3, 4, 5):
        for M in (1, 2, 4, 8, 9):
            one = simulate(make_schedule("1f1b", P, M))
            assert max(one.peak_in_flight) <= P
            assert one.peak_in_flight == [min(P - r, M) for r in range(P)]
            assert simulate(make_schedule("gpipe", P, M)).peak_in_flight == [M] * P
            assert simulate(make_schedule("naive", P, M)).peak_in_flight == [1] * P


def test_looping_holds_every_chunk_and_interleaved_less():
    loop = simulate(make_schedule("looping", 4, 8, 2))
    inter = simulate(make_schedule("interleaved", 4, 8, 2))
    assert loop.peak_in_flight == [16] * 4
    assert max(inter.peak_in_flight) < 16


def test_placement_is_looping():
    assert [S.model_stage(r, c, 2) for c in range(2) for r in range(2)] == [0, 1, 2, 3]
    assert S.stage_location(3, 2) == (1, 1)
    assert list(S.layer_range(1, 8, 4)) == [2, 3]
    assert {name: S.placement_of(name) for name in S.ORDERS if S.placement_of(name) != S.LOOPING} == {"zbv": S.V_SHAPE}


def test_v_placement_puts_both_ends_on_rank_0_and_turns_on_the_last_rank():
    """ZB-V: chunk 0 of rank r is stage r, chunk 1 stage 2P-1-r; stage_location inverts it."""
    for P in (1, 2, 3, 4, 5):
        stages = [S.rank_stages(r, P, 2, S.V_SHAPE) for r in range(P)]
        assert stages == [[r, 2 * P - 1 - r] for r in range(P)]
        assert sorted(s for pair in stages for s in pair) == list(range(2 * P))
        for r in range(P):
            for c in range(2):
                assert S.stage_location(S.model_stage(r, c, P, S.V_SHAPE), P, S.V_SHAPE) == (r, c)
    assert S.make_schedule("zbv", 4, 8, 2).placement == S.V_SHAPE
    # the turn of the V (stage 3 -> 4 on rank 3) is local: rank 3 neither sends to nor receives from itself
    assert all(a.peer != 3 for a in S.make_schedule("zbv", 4, 8, 2).actions[3] if a.peer is not None)


def test_simulator_catches_broken_schedules():
    good = make_schedule("1f1b", 2, 2)
    # Rank 1 waits for the gradient of microbatch 1 before doing anything: nobody can move.
    rank0, rank1 = good.actions
    bad = S.Schedule("bad", 2, 2, 1, (rank0, (Action(S.RECV_GRAD, 0, 0, 0),) + rank1))
    with pytest.raises((Deadlock, ValueError)):
        simulate(bad)
    stuck = S.Schedule("stuck", 2, 1, 1, ((Action(S.RECV_GRAD, 0, 0, 1), Action(S.FORWARD, 0)),
                                          (Action(S.RECV_ACT, 0, 0, 0), Action(S.FORWARD, 0))))
    with pytest.raises(Deadlock, match="deadlocks"):
        simulate(stuck)
    lone = S.Schedule("lone", 2, 1, 1, (tuple(a for a in rank0 if a.op != S.RECV_GRAD), rank1))
    with pytest.raises(ValueError):
        simulate(S.Schedule("lone", 2, 2, 1, lone.actions))
    early = S.Schedule("early", 1, 1, 1, ((Action(S.BACKWARD, 0), Action(S.FORWARD, 0)),))
    with pytest.raises(ValueError, match="before its forward"):
        simulate(early)


@pytest.mark.parametrize("args, fragment", [
    (("zigzag", 2, 4, 1), "unknown pipeline schedule 'zigzag'"),
    (("1f1b", 2, 4, 2), "has no virtual stages"),
    (("gpipe", 2, 0, 1), "microbatches must be a positive integer"),
    (("interleaved", 4, 6, 2), "multiple of the pipeline stages"),
    (("looping", 4, 2, 2), "at least as many microbatches"),
    (("zbv", 2, 4, 1), "runs exactly 2 virtual stages per rank"),
    (("zbv", 2, 4, 3), "runs exactly 2 virtual stages per rank"),
    (("zbv", 4, 6, 2), "needs at least 2P-1 = 7 microbatches for 4 pipeline stages, got 6"),
])
def test_bad_input_is_named(args, fragment):
    assert fragment in S.schedule_problem(*args)
    with pytest.raises(ValueError, match=fragment.split("'")[0]):
        make_schedule(*args)


def test_layers_must_divide():
    assert "cannot be cut into 2 pipeline stages x 2 virtual stages" in S.schedule_problem("looping", 2, 2, 2, 6)
    assert S.schedule_problem("looping", 2, 2, 2, 8) is None


def test_message_tags_are_distinct():
    P, V, M = 3, 2, 6
    tags = {S.message_tag(k, m, s, P * V, M) for k in ("act", "grad") for m in range(M) for s in range(P * V)}
    assert len(tags) == 2 * M * P * V and max(tags) < S.TAG_LIMIT


def test_command_line_chart(capsys):
    assert main(["--schedule", "1f1b", "--pp", "4", "-m", "8"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("rank ")]
    assert len(rows) == 4
    assert rows[3].split("|")[1].split()[:7] == [".", ".", ".", "F0", "B0", "B0", "F1"]
    assert "formula (P-1)/(M+P-1) = 27.3%" in out
    assert main(["--schedule", "interleaved", "--pp", "2", "-m", "4"]) == 0
    assert "F0a" in capsys.readouterr().out
    assert main(["--schedule", "zbv", "--pp", "2", "-m", "4"]) == 0  # V = 2 by default
    assert "V=2 chunks per rank" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        main(["--schedule", "zbv", "--pp", "4", "-m", "4"])
    assert exc.value.code == 2
    assert capsys.readouterr().err.count("needs at least 2P-1 = 7 microbatches") == 1
    with pytest.raises(SystemExit) as exc:
        main(["--schedule", "gpipe", "--pp", "2", "-m", "4", "-v", "2"])
    assert exc.value.code == 2
    assert "has no virtual stages" in capsys.readouterr().err


def test_png(tmp_path, capsys):
    path = tmp_path / "chart.png"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert main(["--schedule", "gpipe", "--pp", "2", "-m", "2", "--png", str(path)]) == 1
        assert "needs matplotlib" in capsys.readouterr().err
        return
    assert main(["--schedule", "gpipe", "--pp", "2", "-m", "2", "--png", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_simulation_with_measured_costs():
    """Replaying a schedule with given per-action times: a slow last stage stretches GPipe."""
    sched = make_schedule("gpipe", 2, 4)
    even = simulate(sched, cost=lambda r, a: 1.0 if a.op == S.FORWARD else 2.0)
    assert even.makespan == simulate(sched).makespan
    slow_last = simulate(sched, cost=lambda r, a: (1.0 if a.op == S.FORWARD else 2.0) * (2 if r == 1 else 1))
    assert slow_last.makespan == 1 + 4 * 2 + 4 * 4 + 2  # F0 on rank 0, rank 1's work, B3 on rank 0
    assert slow_last.bubble[0] > slow_last.bubble[1]


def test_zero_bubble_schedules_cut_1f1b_idle_time_and_keep_their_memory():
    """ZB-H1: a third of 1F1B's idle time for equal F, B, W, and 1F1B's peak (P microbatches
    held, on every rank); ZB-H2: at most 2P-1, and below ZB-H1 when B takes longer than W
    would allow ZB-H1 to hide (here F=1, B=W=1.5)."""
    from minidist.layout.simulate import chart

    for P, M in ((2, 4), (4, 8), (5, 10)):
        one = simulate(make_schedule("1f1b", P, M), 1.0, 2.0)
        h1 = simulate(make_schedule("zb-h1", P, M), 1.0, 2.0)
        idle = [b * h1.makespan for b in h1.bubble]
        assert idle == pytest.approx([(one.bubble[0] * one.makespan) / 3] * P)
        assert h1.peak_in_flight == [P] * P and max(one.peak_in_flight) == P
        h2 = simulate(make_schedule("zb-h2", P, M), 1.0, 2.0)
        assert h2.peak_in_flight == [min(2 * P - 1, M)] * P
        assert simulate(make_schedule("zb-h2", P, M), 1.0, 3.0).makespan < \
            simulate(make_schedule("zb-h1", P, M), 1.0, 3.0).makespan
    text = chart(make_schedule("zb-h1", 4, 8))
    assert "W7" in text and "F forward, B input gradient, W weight gradients" in text


def test_zbv_halves_zb_h1_idle_time_with_1f1b_memory():
    """ZB-V (two half-stage chunks per rank in a V): for equal F, B, W each rank idles (P-1)
    chunk forwards, half ZB-H1's (P-1)F, and holds 2P chunks, i.e. 1F1B's P microbatches of
    activations; the idle time does not grow with M; bubble (P-1)/(6M+P-1)."""
    from minidist.layout.simulate import chart

    for P, M in ((2, 3), (2, 8), (4, 7), (4, 8), (5, 12)):
        zbv = simulate(make_schedule("zbv", P, M, 2), 1.0, 2.0)
        h1 = simulate(make_schedule("zb-h1", P, M), 1.0, 2.0)
        assert zbv.makespan == h1.makespan - (P - 1) * 0.5  # (P-1)F against (P-1)F/2, the same work
        assert zbv.peak_in_flight == [2 * P] * P
        assert zbv.mean_bubble == pytest.approx((P - 1) / (6 * M + P - 1), abs=1e-12)
    text = chart(make_schedule("zbv", 4, 8, 2))
    rank0 = text.splitlines()[1]
    assert rank0.split("|")[1].split()[:9] == ["F0a", "F1a", "F2a", "F3a", "F4a", "F5a", "F6a", "F0b", "B0b"]
    assert "formula (P-1)/(6M+P-1) = 5.9%" in text

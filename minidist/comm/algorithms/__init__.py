"""The textbook algorithms, one short function each, built only on p2p.py's messages.

Read ``ring.py`` first: the ring all-reduce on one screen.  Each module exposes its step
schedule (who sends which block to whom at step k) as a small function, used by its own
algorithm and by the cached plans of :mod:`minidist.comm.fast`, so no index arithmetic is
derived twice.

=================  ==================================================  =========================
module             algorithms (schedule)                               sent per rank (X bytes)
=================  ==================================================  =========================
ring.py            ring reduce-scatter, all-gather, all-reduce         2(N-1)/N X (all-reduce)
                   (ring_steps)
doubling.py        recursive doubling all-reduce                       log2(N) X
                   (recursive_doubling_schedule); halving
                   reduce-scatter (halving_steps); doubling
                   all-gather (doubling_gather_steps); Rabenseifner     2(N-1)/N X
pairwise.py        pairwise reduce-scatter and all-to-all               (N-1)/N X
                   (pairwise_steps); the 2-rank all-gather swap        (N-1) X_own
oneshot.py         one-shot all-gather / reduce-scatter (peers)        (N-1)/N X, one round
bruck.py           Bruck all-gather, with row counts (bruck_steps)     (N-1) (X_own + 8)
evengather.py      all-gather of equal blocks into out= (one-shot,     (N-1) X_own
                   doubling or ring schedules)
trees.py           binomial broadcast / reduce, dissemination barrier  root: log2(N) X
pipelined.py       chunked ring reduce-scatter, chain broadcast/reduce X (chains)
blocks.py          the all-gather rows rule (blocks: layout/split.py)
=================  ==================================================  =========================
"""

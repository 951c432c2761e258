"""The training command's flags for long sequences, and their checks (no MPI needed to read them).

``--attention {plain,blockwise}`` and ``--attention-block B`` choose the attention of one rank
(minidist/ops/blockwise.py); ``--cp C`` and ``--cp-impl {ring,ulysses}`` split every sequence
over C ranks (minidist/parallel/context.py).  Bad combinations are refused on every rank
before any message is sent (``check_arguments``; train.py turns its ValueError into one line
and exit code 2).
"""

from __future__ import annotations

IMPLEMENTATIONS = ("ring", "ulysses")
ATTENTIONS = ("plain", "blockwise")  # nn.ATTENTIONS, named here: importing nn would load the backend
                                     # before train.py has checked MINIDIST_BACKEND (a test keeps them equal)


def add_arguments(parser, positive) -> None:
    """The ``long sequences`` flags of the training command (``positive``: its int type >= 1)."""
    a = parser.add_argument_group("long sequences")
    a.add_argument("--attention", choices=ATTENTIONS, default="plain",
                   help="plain keeps the T x T probabilities; blockwise (FlashAttention's online softmax) "
                        "holds one block x block tile at a time")
    a.add_argument("--attention-block", type=positive, default=None, metavar="B",
                   help="query/key block of blockwise attention, of ring attention's tiles and of Ulysses' "
                        "blockwise attention (default: 128)")
    a.add_argument("--cp", type=positive, default=1, metavar="C",
                   help="context parallelism: split every sequence over C ranks")
    a.add_argument("--cp-impl", choices=IMPLEMENTATIONS, default=None,
                   help="ring: K/V blocks circulate (zig-zag layout, --seq-len divisible by 2C); "
                        "ulysses: all-to-all to head-sharded attention (--heads divisible by C) (default: ring)")


def check_arguments(args) -> None:
    """ValueError naming the flags when --cp cannot split this model (checked on every rank
    before any message)."""
    cp = getattr(args, "cp", 1)
    blockwise = cp > 1 or getattr(args, "attention", "plain") == "blockwise"
    if getattr(args, "attention_block", None) is not None and not blockwise:
        raise ValueError(f"--attention-block {args.attention_block} needs --attention blockwise or --cp > 1 "
                         "(plain attention has no blocks)")
    if getattr(args, "cp_impl", None) is not None and cp == 1:
        raise ValueError(f"--cp-impl {args.cp_impl} needs --cp greater than 1 (got --cp {cp})")
    # Defaults, set once the flags given have been checked against the axis they need.
    args.attention_block = 128 if getattr(args, "attention_block", None) is None else args.attention_block
    args.cp_impl = "ring" if getattr(args, "cp_impl", None) is None else args.cp_impl
    if cp == 1:
        return
    if getattr(args, "zero", None) or getattr(args, "hsdp_shard", None):
        raise ValueError(f"--cp {cp} composes with DDP only: --zero and --hsdp-shard are not supported with it")
    if getattr(args, "tp", 1) > 1:
        raise ValueError(f"--cp {cp} with --tp {args.tp} is not supported yet: use one of them (with --dp)")
    if args.cp_impl == "ring" and args.seq_len % (2 * cp):
        raise ValueError(f"--seq-len {args.seq_len} is not divisible by 2 x --cp = {2 * cp}: zig-zag ring attention "
                         "gives each rank two equal chunks of every sequence")
    if args.cp_impl == "ulysses" and args.heads % cp:
        raise ValueError(f"--heads {args.heads} is not divisible by --cp {cp}: Ulysses gives each rank "
                         "heads / cp of the attention heads")
    if args.cp_impl == "ulysses" and args.seq_len % cp:
        raise ValueError(f"--seq-len {args.seq_len} is not divisible by --cp {cp}")


def score_values(args) -> int:
    """Attention scores one block keeps per sequence on one rank, for the memory estimate:
    plain attention keeps H x T x T, blockwise one tile per head; ring attention one tile of
    its chunks; Ulysses its H / C heads over the whole sequence."""
    T, H, cp = args.seq_len, args.heads, getattr(args, "cp", 1)
    block = getattr(args, "attention_block", 128)
    blockwise = getattr(args, "attention", "plain") == "blockwise"
    if cp > 1 and args.cp_impl == "ring":
        return H * min(block, max(1, T // (2 * cp))) ** 2
    heads = H // cp if cp > 1 else H
    return heads * (min(block, T) ** 2 if blockwise else T * T)

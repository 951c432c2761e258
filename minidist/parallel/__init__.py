"""minidist.parallel: the parallel training strategies (context parallelism: context.py)."""

"""Parallel training strategies over the axes of a comm.Mesh (dp, pp, cp, tp)."""

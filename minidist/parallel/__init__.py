"""minidist.parallel: the four axes of large-model training and their composer.

Each axis is an object built from the parameters and the ``comm.Group`` (or ``Mesh``) it
works over; it never reaches for a global.  Start reading at ``compose.py`` (one function
puts the axes together) and ``strategy.py`` (the one interface the training loop calls);
docs/architecture.md has the module map.

Imports host, layout, model and comm; never the planner, the state, the instruments or the
training command (the tracer wraps a strategy from outside, at its seams).
"""

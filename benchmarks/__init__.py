"""Benchmarks: each measures one thing side by side with what it replaces, in one run, and states
the machine. Run one as `python -m benchmarks.<name>`."""

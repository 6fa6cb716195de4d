"""A/B experiments behind decisions recorded in docs/research/experiments.md (a CPU plan, a memory layout, a split
of the work): each times two ways of doing one thing, often by flipping a private knob of the library. They are not
product benchmarks (those are `bench/*.py`, which time what serving runs); they stay so that a decision can be
measured again on other hardware."""

"""The conformance suite: Backend protocol, harness, Hypothesis state machine, CLI, bug zoo."""

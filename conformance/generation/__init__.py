"""Generation: the traces the harness runs, how they are drawn, walked, shrunk, and made the same in every run.

| module | owns |
|---|---|
| `machine`, `race_rules`, `running_rules` | the state machine: the rules that choose ops (the race and running-request rules apart) |
| `request_machine` | client traffic for request-path targets, and the run that sends it |
| `draws`, `runner` | what the rules draw from, and the loop that runs them on Hypothesis's choices |
| `fuzz` | the machine on a seeded random walk instead of Hypothesis (`kvcert fuzz`) |
| `shrink` | trace shrinking |
| `determinism` | same seed, same run: `fixed_generation`, the step digest |
| `interrupt` | Ctrl-C that stops a run (`sigint_deferred`): the walk stops at its next step, not in a gc callback |
| `hypothesis_compat` | every use of Hypothesis's internals, in one module |
"""

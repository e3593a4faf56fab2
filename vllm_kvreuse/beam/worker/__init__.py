"""A beam step next to the logits, in the workers (torch, runner-agnostic
but for the runners' patches).

- ``job.py``: a step's groups inside the sampler, selected as one batch;
- ``state.py``: a live group's beams as worker state across steps;
- ``select.py``: the groups' step on the logits' device: the next beams and
  which member carries each;
- ``candidates.py``: the (beam, token) pairs that may be among a group's
  next beams (fixed shapes on an accelerator, pruned on CPU);
- ``segments.py``: many groups laid end to end in flat tensors (ranking,
  carriers and block copies per group, in operations that do not grow with
  the number of groups);
- ``runner_hooks.py``: both model runners' samplers run the step's groups
  (registered patches; the one module that reads runner state).
"""
